"""TCP pools need a token (issue 47): a loopback port can be reached by every user of the machine (a unix socket is
0600), and a pool's calls install models and make rank 0 read any file its user can. The rank and the launcher
refuse --port without a token unless the operator passes --insecure-no-token; a pool ClientEngine spawns on TCP
gets a token of its own (a 0600 file in its 0700 directory) that its ClientEngine uses, and another client without
it is refused."""
from __future__ import annotations

import os
import socket
import stat

import pytest

from allspark_client import ClientEngine, settings
from allspark_client.client import PoolAccessDenied

START_TIMEOUT_S = 120.0
REFUSAL_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_without_a_token_is_refused_unless_the_operator_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ALLSPARK_TOKEN", raising=False)
    from allspark_client.launch.launcher import main as launch
    from allspark_client.launch.options import parse_args as launcher_args
    from allspark_client.launch.options import refuse_tcp_without_token
    from allspark_server.pool.rank import grpc_address, parse_args

    with pytest.raises(SystemExit) as info:                                   # the rank
        grpc_address(parse_args(["--port", "5"]))
    message = str(info.value.code)
    assert "TCP port 5 on 127.0.0.1 can be reached by every user of this machine" in message, message
    assert "--token-file" in message and "$ALLSPARK_TOKEN" in message and "--insecure-no-token" in message
    with pytest.raises(SystemExit, match="can be reached by every user"):     # the launcher, before mpirun
        refuse_tcp_without_token(launcher_args(["--port", "5"]))
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    assert grpc_address(parse_args(["--port", "5", "--token-file", str(token)]))[1].token == "t0k3n"
    refuse_tcp_without_token(launcher_args(["--port", "5", "--token-file", str(token)]))
    assert grpc_address(parse_args(["--port", "5", "--insecure-no-token"]))[1].token is None
    refuse_tcp_without_token(launcher_args(["--port", "5", "--insecure-no-token"]))
    with settings.override(TOKEN="t0k3n"):                                   # $ALLSPARK_TOKEN
        assert grpc_address(parse_args(["--port", "5"]))[1].token == "t0k3n"
        refuse_tcp_without_token(launcher_args(["--port", "5"]))
    refuse_tcp_without_token(launcher_args([]))                               # a unix socket needs none
    # the operator's --insecure-no-token reaches the ranks
    assert launch(["--dry-run", "--topology", "0:0-1", "--ranks", "1", "--no-numactl", "--port", "5",
                   "--insecure-no-token"]) == 0
    assert "--insecure-no-token" in capsys.readouterr().out


def test_a_pool_spawned_on_tcp_gets_a_token_only_its_client_holds(monkeypatch):
    monkeypatch.delenv("ALLSPARK_TOKEN", raising=False)
    port = free_port()
    address = f"127.0.0.1:{port}"
    client = ClientEngine(ranks=1, launcher_args=("--port", str(port)), start_timeout_s=START_TIMEOUT_S)
    try:
        assert client.address == address and client.get_version_full()
        token_file = os.path.join(client._pool.dir, "token")
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(client._pool.dir).st_mode) == 0o700
        for token in (None, "wrong-token"):                                  # any other local user
            with pytest.raises(PoolAccessDenied, match="missing or wrong bearer token"):
                ClientEngine(address, token=token, start_timeout_s=REFUSAL_TIMEOUT_S)
        with open(token_file) as f:
            other = ClientEngine(address, token=f.read().strip(), start_timeout_s=REFUSAL_TIMEOUT_S)
        assert other.get_version_full()
        other.close()
    finally:
        client.close()
    assert not os.path.exists(token_file)
