"""Clients that stall a pool: one that never reads its stream (dropped after --stream-stall-timeout, its request
released) and connections that never finish their handshake (slowloris); the pool serves others exactly
meanwhile. Pools come from `new_pool` (one per test, every process killed at teardown)."""
from __future__ import annotations

import time

import grpc
import pytest
from helpers import LONG_RUN_MAX_LENGTH, LONG_RUN_TOKENS, hf_greedy, random_prompt
from pool_helpers import MODEL, REDO_SPOILED, PremiseSpoiled, client_greedy, install, wait_until
from test_pool_grpc import SERVICE

from allspark_client._proto import allspark_pb2 as pb


# ---- 1. a client that never reads its stream -------------------------------------------------------
@REDO_SPOILED
def test_a_stream_nobody_reads_is_dropped_and_its_request_released(new_pool, loader, llama):
    """A raw client starts an 8000-token stream with a 1 KiB flow-control window and never reads past the first
    reply: the pool's writes to it wait, and after --stream-stall-timeout 2 the pool ends it RESOURCE_EXHAUSTED,
    saying why, and releases the request (running_request back to 0, every span free) while another client is
    served transformers' output throughout."""
    pool = new_pool(extra_args=("--stream-stall-timeout", "2"))
    client = pool.client()
    install(client, loader, max_length=LONG_RUN_MAX_LENGTH)
    idle = client.get_as_engine_stat(MODEL)
    channel = grpc.insecure_channel(pool.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                           ("grpc.http2.bdp_probe", 0)])
    try:
        stream = channel.unary_stream(SERVICE + "Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                                      response_deserializer=pb.GenerateReply.FromString)
        call = stream(pb.GenerateRequest(model_name=MODEL, input_ids=random_prompt(8, seed=90),
                                         config=pb.GenerationConfig(top_k=1, max_new_tokens=LONG_RUN_TOKENS)))
        first = next(call)
        assert first.status == 0 and first.request_id
        started = time.monotonic()
        # the first reply comes when the request is accepted; the engine thread schedules it at its next step, and
        # it runs until the stall timeout drops it (~2 s): a stall of this process as long is checked for below
        seen_running = wait_until(lambda: client.get_as_engine_stat(MODEL).running_request == 1, 30)
        prompt = random_prompt(9, seed=91)
        assert client_greedy(client, prompt, 8) == hf_greedy(llama.model, prompt, 8)     # served meanwhile
        dropped_yet = client.get_as_engine_stat(MODEL).running_request == 0

        def released():
            stat = client.get_as_engine_stat(MODEL)
            return stat.running_request == 0 and stat.pendding_request == 0 and stat.free_span == idle.free_span
        assert wait_until(released, 30.0, 0.2), client.get_as_engine_stat(MODEL)
        dropped_after = time.monotonic() - started
        received = 0
        with pytest.raises(grpc.RpcError) as e:
            for reply in call:              # what was buffered, then the status
                received += len(reply.ids)
        assert received < LONG_RUN_TOKENS
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "did not read its stream for 2 s" in e.value.details()
        assert client_greedy(client, prompt, 8) == hf_greedy(llama.model, prompt, 8)
        assert pool.proc.poll() is None
        if not seen_running or dropped_yet:
            raise PremiseSpoiled(f"the request was dropped {dropped_after:.1f} s after it started, before this "
                                 f"process {'saw it run' if not seen_running else 'was served beside it'}")
        print(f"a stream nobody read was dropped and its request released {dropped_after:.1f}s after it started; "
              f"{received} tokens had reached the client")
    finally:
        channel.close()


# ---- 2. slowloris: connections that never finish their handshake ----------------------------------
def test_idle_and_trickling_connections_do_not_starve_the_pool(new_pool, loader, llama):
    """300 connections to the pool's socket that send nothing, and 50 that trickle the start of an HTTP/2
    preface: the pool serves a normal client exactly meanwhile, and closes every one of them once gRPC's
    handshake time limit (service.HANDSHAKE_TIMEOUT_MS, 10 s) has passed."""
    import socket as socketlib

    from allspark_server.pool.service import HANDSHAKE_TIMEOUT_MS
    pool = new_pool()
    client = pool.client()
    install(client, loader)
    silent, trickling = [], []
    try:
        for i in range(350):
            s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            s.connect(pool.socket)
            (silent if i < 300 else trickling).append(s)
        opened = time.monotonic()
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        for s in trickling:
            s.sendall(preface[:3])
        prompt = random_prompt(9, seed=95)
        assert client_greedy(client, prompt, 12) == hf_greedy(llama.model, prompt, 12)
        for s in trickling:
            s.sendall(preface[3:6])
        assert client_greedy(client, prompt, 12) == hf_greedy(llama.model, prompt, 12)

        def closed_by_pool(s) -> bool:
            s.settimeout(0.05)
            try:
                return s.recv(4096) == b""
            except (socketlib.timeout, BlockingIOError):
                return False
            except OSError:
                return True
        bound = HANDSHAKE_TIMEOUT_MS / 1000 + 20
        pending = silent + trickling
        while pending and time.monotonic() - opened < bound:
            pending = [s for s in pending if not closed_by_pool(s)]
        assert not pending, f"{len(pending)} of 350 connections still open {bound:.0f} s after they were made"
        closed_after = time.monotonic() - opened
        assert client_greedy(client, prompt, 12) == hf_greedy(llama.model, prompt, 12)
        assert pool.proc.poll() is None
        print(f"350 stalled connections closed by the pool within {closed_after:.1f}s; it served exactly meanwhile")
    finally:
        for s in silent + trickling:
            s.close()
