"""Who may reach a pool (allspark_server/access.py, allspark_client/channel.py), on real 1-rank pools: the unix
socket 0600 in a 0700 directory (another user is refused by the kernel; a --socket-group member is let in), and
a TCP pool with --allow-remote, which must serve TLS and check a bearer token on every RPC: right token and CA
served, wrong or missing token refused as PoolAccessDenied, a plaintext client gets nothing, client certificates
required with --tls-client-ca; an address where no pool answers fails at once with gRPC's reason. Certificates
are made with the openssl command line."""
from __future__ import annotations

import errno
import grp
import os
import shutil
import socket
import stat
import subprocess

import pytest

from allspark_client import AsException, AsStatus, ClientEngine, settings
from allspark_client.client import PoolAccessDenied, PoolUnavailable

NOBODY = 65534
TOKEN = "s3cret-token-0123456789"
REFUSAL_TIMEOUT_S = 1.0    # a client the pool's TLS refuses retries until then; the reason it reports comes from
                           # one more call after (ClientEngine._why_not), however long it tried


def connect_as(uid: int, gid: int, path: str) -> int:
    """errno of connecting to the unix socket as another user (a forked child drops to uid/gid); 0 if it connects."""
    pid = os.fork()
    if pid == 0:    # the child: no Python-level cleanup, only the syscalls, then _exit with the result
        code = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
        except OSError as e:
            code = e.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")


@needs_root
def test_unix_socket_is_0600_in_a_0700_directory_and_another_user_is_refused(new_pool):
    pool = new_pool(ranks=1, socket_name="private/pool.sock")
    directory = os.path.dirname(pool.socket)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700           # created by the pool
    assert stat.S_IMODE(os.stat(pool.socket).st_mode) == 0o600
    assert connect_as(NOBODY, NOBODY, pool.socket) == errno.EACCES      # the directory stops it
    os.chmod(directory, 0o755)                                          # and with the directory open ...
    try:
        assert connect_as(NOBODY, NOBODY, pool.socket) == errno.EACCES  # ... the socket's own mode does
    finally:
        os.chmod(directory, 0o700)
    assert connect_as(os.getuid(), os.getgid(), pool.socket) == 0
    assert pool.client().get_version_full()


@needs_root
def test_socket_group_members_are_let_in(new_pool):
    group = grp.getgrgid(NOBODY) if NOBODY in {g.gr_gid for g in grp.getgrall()} else None
    if group is None:
        pytest.skip("no group with gid 65534")
    pool = new_pool(ranks=1, socket_name="shared/pool.sock", extra_args=("--socket-group", group.gr_name))
    directory = os.path.dirname(pool.socket)
    assert (stat.S_IMODE(os.stat(directory).st_mode), os.stat(directory).st_gid) == (0o710, NOBODY)
    assert (stat.S_IMODE(os.stat(pool.socket).st_mode), os.stat(pool.socket).st_gid) == (0o660, NOBODY)
    os.chmod(pool.dir, 0o711)            # the test's own temporary parent: let others pass through it
    assert connect_as(NOBODY, NOBODY, pool.socket) == 0                 # a member of the group
    assert connect_as(NOBODY - 1, NOBODY - 1, pool.socket) == errno.EACCES   # anybody else


def test_a_socket_directory_others_can_write_is_refused(tmp_path):
    from allspark_server.pool.access import AccessError, prepare_socket_dir
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(AccessError, match="writable by others: another user could replace the socket"):
        prepare_socket_dir(str(shared / "pool.sock"), None)
    os.chmod(shared, 0o1777)                                            # sticky, as /tmp: nobody else can
    prepare_socket_dir(str(shared / "pool.sock"), None)                 # replace our socket there


# ---- TCP: TLS and the token --------------------------------------------------------------------------
def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=allspark test CA",
             cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for who in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.pem", "-days", "2", *(["-extfile", "server.ext"] if who == "server" else []), cwd=d)
    (d / "token").write_text(TOKEN + "\n")
    os.chmod(d / "token", 0o600)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tls_pool(new_pool, certs, *extra: str):
    port = free_port()
    pool = new_pool(ranks=1, extra_args=("--port", str(port), "--allow-remote", "--tls-cert", str(certs / "server.pem"),
                                         "--tls-key", str(certs / "server.key"), "--token-file", str(certs / "token"),
                                         *extra))
    return pool, f"127.0.0.1:{port}"


def test_a_remote_pool_needs_tls_and_a_token_and_checks_the_token_on_every_call(new_pool, certs, monkeypatch):
    monkeypatch.delenv("ALLSPARK_TOKEN", raising=False)
    pool, address = tls_pool(new_pool, certs)
    ca = str(certs / "ca.pem")
    good = ClientEngine(address, token=TOKEN, root_certificates=ca, start_timeout_s=30)
    assert good.get_version_full()
    with pytest.raises(AsException, match="'nothing-installed' is not installed"):   # a call past Health: the
        good.get_model_info("nothing-installed")                                      # engine answered it
    good.close()
    with settings.override(TOKEN=TOKEN):                                 # the environment's token works too
        ClientEngine(address, root_certificates=ca, start_timeout_s=30).close()
    for token in ("wrong-token", None):
        with pytest.raises(PoolAccessDenied) as info:
            ClientEngine(address, token=token, root_certificates=ca, start_timeout_s=30)
        assert "UNAUTHENTICATED" in info.value.message and "missing or wrong bearer token" in info.value.message
        assert info.value.status == AsStatus.ALLSPARK_REQUEST_DENIED
        assert "wrong-token" not in info.value.message
    with pytest.raises(PoolUnavailable) as info:                         # plaintext against TLS: nothing
        ClientEngine(address, token=TOKEN, start_timeout_s=REFUSAL_TIMEOUT_S)
    assert "pass root_certificates" in info.value.message
    assert not isinstance(info.value, PoolAccessDenied)
    assert TOKEN not in pool.log()                                       # never logged


def test_client_certificates_are_required_with_tls_client_ca(new_pool, certs):
    pool, address = tls_pool(new_pool, certs, "--tls-client-ca", str(certs / "ca.pem"))
    ca = str(certs / "ca.pem")
    with pytest.raises(PoolUnavailable, match="root_certificates signed"):
        ClientEngine(address, token=TOKEN, root_certificates=ca, start_timeout_s=REFUSAL_TIMEOUT_S)
    client = ClientEngine(address, token=TOKEN, root_certificates=ca, certificate_chain=str(certs / "client.pem"),
                          private_key=str(certs / "client.key"), start_timeout_s=30)
    assert client.get_version_full()
    client.close()


def test_bad_access_setups_stop_the_rank_before_it_serves(tmp_path, certs):
    from allspark_server.pool.rank import grpc_address, parse_args
    cert, key = str(certs / "server.pem"), str(certs / "server.key")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [(["--port", "5", "--tls-cert", cert], "--tls-cert and --tls-key go together"),
             (["--socket", str(tmp_path / "s.sock"), "--tls-cert", cert, "--tls-key", key], "--tls-cert is for TCP"),
             (["--port", "5", "--token-file", str(empty)], "holds an empty token"),
             (["--port", "5", "--token-file", str(tmp_path / "missing")], "cannot read the token file"),
             (["--port", "5", "--allow-remote", "--tls-cert", cert, "--tls-key", key], "missing --token-file")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            grpc_address(parse_args(argv))
        assert message in str(info.value.code), argv


def test_an_address_nothing_answers_on_fails_at_once_with_grpc_reason(tmp_path):
    """No pool to wait for: a missing socket, a closed port, an HTTP server's port fail with gRPC's reason instead
    of waiting for start_timeout_s (300 s by default). Given start_timeout_s, an absent pool is waited for."""
    import http.server
    import threading
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        for address, reason in ((f"unix:{tmp_path}/typo.sock", "No such file or directory"),
                                (f"127.0.0.1:{closed_port}", "Connection refused"),
                                (f"127.0.0.1:{web.server_address[1]}", "not gRPC: an HTTP server")):
            started = time.monotonic()
            with pytest.raises(PoolUnavailable) as info:
                ClientEngine(address)
            # a bound far from the 300 s this used to wait, not a speed measurement
            assert time.monotonic() - started < 30, address
            assert info.value.message.startswith(f"no pool answers at {address}: UNAVAILABLE") and \
                reason in info.value.message, info.value.message
    finally:
        web.shutdown()
    with pytest.raises(PoolUnavailable, match=r"no ready pool at .* after 1s: UNAVAILABLE: .*No such file"):
        ClientEngine(f"unix:{tmp_path}/typo.sock", start_timeout_s=1.0)
