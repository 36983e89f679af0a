"""The pool's gRPC surface given hostile input: malformed bytes, truncated messages, wrong wire types, oversized
messages, unknown methods and bad values on a raw channel, each answered without harm to the pool; and the bind
rules of `python -m allspark_server` (loopback by default, beyond it only with TLS and a token). Clients that load
the pool: tests/pool/test_pool_load.py; clients that stall it: tests/pool/test_pool_slow_clients.py. Pools come from
`new_pool` (one per test, every process killed at teardown)."""
from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from helpers import hf_greedy, random_prompt
from pool_helpers import MODEL, REPO, client_greedy, install, repo_env

from allspark_client._proto import allspark_pb2 as pb
from allspark_client.types import AsStatus

# ---- 1. malformed input on a raw channel ----------------------------------------------------------
SERVICE = "/allspark.v1.Allspark/"


def raw_unary(channel, method: str, payload: bytes, timeout: float = 30.0) -> bytes:
    call = channel.unary_unary(SERVICE + method if not method.startswith("/") else method,
                               request_serializer=None, response_deserializer=None)
    return call(payload, timeout=timeout)


def raw_stream(channel, method: str, payload: bytes, timeout: float = 30.0) -> list[bytes]:
    call = channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
    return list(call(payload, timeout=timeout))


# what the pool answers for bytes that do not parse as the request message: INVALID_ARGUMENT naming its type
# (interceptors.GuardCalls; grpc.aio by itself answers UNKNOWN, the code of an exception a servicer let out)
UNPARSEABLE = (grpc.StatusCode.INVALID_ARGUMENT,)


def expect_rpc_error(fn, *codes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() in codes, (info.value.code(), info.value.details())
    return info.value


def test_raw_grpc_malformed_input(new_pool, loader, llama):
    pool = new_pool()
    client = pool.client()
    install(client, loader)
    prompt = random_prompt(7, seed=31)
    want = hf_greedy(llama.model, prompt, 8)
    channel = grpc.insecure_channel(pool.address)
    checks = []

    def still_serves(what: str) -> None:
        checks.append(what)
        assert pool.proc.poll() is None, f"the pool died after {what}:\n{pool.log()}"
        assert client_greedy(client, prompt, 8) == want, f"wrong tokens after {what}"

    try:
        still_serves("nothing")

        # (a) garbage bytes
        expect_rpc_error(lambda: raw_unary(channel, "GetEngineStat", b"\xff\x00garbage"), *UNPARSEABLE)
        expect_rpc_error(lambda: raw_stream(channel, "Generate", b"\xff\x00garbage"), *UNPARSEABLE)
        expect_rpc_error(lambda: raw_unary(channel, "InstallModel", b"\xff\x00garbage"), *UNPARSEABLE)
        still_serves("garbage bytes")

        # (b) a valid GenerateRequest cut in half (inside the packed input_ids)
        whole = pb.GenerateRequest(model_name=MODEL, input_ids=list(range(3, 200)),
                                   config=pb.GenerationConfig(top_k=1, max_new_tokens=4)).SerializeToString()
        expect_rpc_error(lambda: raw_stream(channel, "Generate", whole[:len(whole) // 2]), *UNPARSEABLE)
        still_serves("a truncated GenerateRequest")

        # (c) wrong wire types: ModelRef.model_name (string, field 1) sent as a varint. protobuf keeps a
        # field of the wrong wire type as an unknown field, so this is a ModelRef with an empty name.
        for method in ("GetEngineStat", "GetModelInfo", "StartModel"):
            try:
                data = raw_unary(channel, method, b"\x08\x05")
            except grpc.RpcError as e:
                assert e.code() in UNPARSEABLE, (method, e.code(), e.details())
                continue
            reply = {"GetEngineStat": pb.EngineStat, "GetModelInfo": pb.TextReply,
                     "StartModel": pb.StatusReply}[method].FromString(data)
            assert reply.status != 0 and reply.message, (method, reply)
        # GenerateRequest.input_ids (repeated int64) as a fixed64 and config (message) as a varint
        bad_generate = (pb.GenerateRequest(model_name=MODEL).SerializeToString()
                        + b"\x11" + (5).to_bytes(8, "little") + b"\x18\x07")
        try:
            replies = raw_stream(channel, "Generate", bad_generate)
        except grpc.RpcError as e:
            assert e.code() in UNPARSEABLE, (e.code(), e.details())
        else:
            first = pb.GenerateReply.FromString(replies[0])
            assert len(replies) == 1 and first.status == AsStatus.ALLSPARK_EMPTY_REQUEST and first.message, replies
        still_serves("wrong wire types")

        # (d) a message over the 64 MiB limit
        def send_oversized():
            big = pb.ModelRef(model_name="x" * ((64 << 20) + 1024)).SerializeToString()
            raw_unary(channel, "GetEngineStat", big)

        error = expect_rpc_error(send_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "larger than max" in error.details(), error.details()
        still_serves("an oversized message")

        # (e) unknown methods and services
        expect_rpc_error(lambda: raw_unary(channel, "NoSuchMethod", b""), grpc.StatusCode.UNIMPLEMENTED)
        expect_rpc_error(lambda: raw_unary(channel, "/allspark.v0.Nope/Health", b""), grpc.StatusCode.UNIMPLEMENTED)
        still_serves("unknown methods")

        # (f) well-formed requests with bad values: a reply with a nonzero status and a reason
        def generate_fails(request: pb.GenerateRequest, status: AsStatus | None = None) -> None:
            replies = raw_stream(channel, "Generate", request.SerializeToString())
            assert len(replies) == 1, (request, replies)
            first = pb.GenerateReply.FromString(replies[0])
            assert first.status != 0 and first.message, (request, first)
            if status is not None:
                assert first.status == status, (request, first)

        ok_cfg = pb.GenerationConfig(top_k=1, max_new_tokens=4)
        generate_fails(pb.GenerateRequest(model_name="", input_ids=prompt, config=ok_cfg),
                       AsStatus.ALLSPARK_PARAM_ERROR)
        generate_fails(pb.GenerateRequest(model_name="no-such-model", input_ids=prompt, config=ok_cfg),
                       AsStatus.ALLSPARK_PARAM_ERROR)
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=[5, -1, 6], config=ok_cfg),
                       AsStatus.ALLSPARK_PARAM_ERROR)
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=[5, 1 << 40], config=ok_cfg),
                       AsStatus.ALLSPARK_PARAM_ERROR)
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=[], config=ok_cfg),
                       AsStatus.ALLSPARK_EMPTY_REQUEST)
        for bad in (dict(top_logprobs=1 << 40, logprobs=True), dict(top_logprobs=-1), dict(top_k=-5),
                    dict(temperature=float("nan")), dict(temperature=-1.0), dict(top_p=0.0),
                    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(max_length=1 << 62),
                    dict(min_length=-1), dict(repetition_penalty=float("inf"))):
            generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=prompt,
                                              config=pb.GenerationConfig(**bad)))
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=prompt,
                                          config=pb.GenerationConfig(has_eos_token_id=True, eos_token_id=[-2])))
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=prompt,
                                          config=pb.GenerationConfig(stop_words_ids=[pb.TokenIds(ids=[])])))
        generate_fails(pb.GenerateRequest(model_name=MODEL, input_ids=[5] * 5000, config=ok_cfg))
        # other RPCs with bad values reply with a status, too
        for method, request, reply_type in (
                ("StopRequest", pb.RequestRef(model_name=MODEL, request_id=987654), pb.StatusReply),
                ("ReleaseRequest", pb.RequestRef(model_name="nope", request_id=1), pb.StatusReply),
                ("SyncRequest", pb.SyncRequestMsg(model_name=MODEL, request_id=(1 << 64) - 1), pb.StatusReply),
                ("StopModel", pb.ModelRef(model_name="nope"), pb.StatusReply),
                ("GetModelInfo", pb.ModelRef(model_name="nope"), pb.TextReply),
                ("InstallModel", pb.RuntimeConfig(model_name="broken", model_path="/nonexistent/x.asgraph",
                                                  weights_path="/nonexistent/x.asparam", compute_unit="CPU:0",
                                                  engine_max_length=64, engine_max_batch=1), pb.StatusReply)):
            reply = reply_type.FromString(raw_unary(channel, method, request.SerializeToString()))
            assert reply.status != 0 and reply.message, (method, reply)
        still_serves("bad values")
    finally:
        channel.close()
    assert len(checks) == 7


# ---- 2. bind rules ----------------------------------------------------------------------------------
def test_bind_rules(tmp_path, monkeypatch):
    from allspark_server.pool.rank import default_socket_path, grpc_address, parse_args

    with pytest.raises(SystemExit) as info:
        grpc_address(parse_args(["--port", "5", "--host", "0.0.0.0"]))
    assert "--allow-remote" in str(info.value.code)
    for host in ("10.1.2.3", "::", "example.com"):
        with pytest.raises(SystemExit):
            grpc_address(parse_args(["--port", "5", "--host", host]))
    with pytest.raises(SystemExit) as info:                                # beyond loopback: TLS and a token
        grpc_address(parse_args(["--port", "5", "--host", "0.0.0.0", "--allow-remote"]))
    assert "needs TLS and a token; missing --tls-cert/--tls-key and --token-file" in str(info.value.code)
    for name in ("cert.pem", "key.pem", "token"):
        (tmp_path / name).write_text("x")
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    remote = ["--port", "5", "--host", "0.0.0.0", "--allow-remote", *tls, "--token-file", str(tmp_path / "token")]
    assert grpc_address(parse_args(remote))[0] == "0.0.0.0:5"
    plain = "--insecure-no-token"                                        # TCP without a token: test_pool_tokens.py
    assert grpc_address(parse_args(["--port", "5", plain]))[0] == "127.0.0.1:5"   # TCP binds loopback by default
    assert grpc_address(parse_args(["--port", "5", "--host", "localhost", plain]))[0] == "localhost:5"
    with pytest.raises(SystemExit):                                        # one of the two, not both
        parse_args(["--port", "5", "--socket", str(tmp_path / "s.sock")])

    # the default is a unix socket (here under a private XDG_RUNTIME_DIR: nobody else's socket is touched)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "allspark" / "pool.sock")
    assert grpc_address(parse_args([]))[0] == "unix:" + str(tmp_path / "allspark" / "pool.sock")
    sock = tmp_path / "explicit.sock"
    assert grpc_address(parse_args(["--socket", str(sock)]))[0] == f"unix:{sock}"

    # the real entry point refuses too: exits non-zero and says why
    env = repo_env()
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "allspark_server", "--port", "5", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode != 0
    assert "--allow-remote" in proc.stdout + proc.stderr
    assert "allspark pool ready" not in proc.stdout
