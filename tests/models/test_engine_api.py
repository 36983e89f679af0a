"""The Engine's public API as users call it: lifecycle, streaming statuses, stop rules, stats, info."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

from helpers import (
    LONG_RUN_MAX_LENGTH,
    LONG_RUN_TOKENS,
    RecordingQueue,
    assert_same_tokens,
    collect,
    generate,
    hf_greedy,
    random_prompt,
)
from pool_helpers import REDO_SPOILED, PremiseSpoiled

import allspark_server.engine.engine as engine_module
from allspark_client import AsStatus, GenerateRequestStatus

S = GenerateRequestStatus
HANG_S = 120.0


def test_status_sequence_and_stat_info(served_llama, monkeypatch):
    engine, _ = served_llama
    monkeypatch.setattr(engine_module, "ResultQueue", RecordingQueue)
    prompt = random_prompt(30, seed=5)
    status, handle, queue = engine.start_request("llama", {"input_ids": prompt},
                                                 {"top_k": 1, "max_new_tokens": 12, "eos_token_id": []})
    assert status == AsStatus.ALLSPARK_SUCCESS
    tokens, elements, final = collect(queue)
    assert final == S.GenerateFinished and len(tokens) == 12 == queue.GeneratedLength()
    assert queue.history == [S.Init, S.ContextFinished, S.Generating, S.GenerateFinished]
    assert queue.Get() is None and queue.GetNoWait() is None       # nothing left, no blocking
    info = queue.RequestStatInfo()
    assert info["context_token_length"] == 30 and info["generated_token_length"] == 12
    assert info["arrival_time"] <= info["first_token_time"] <= info["last_token_time"] <= info["finished_time"]
    assert info["time_to_first_token"] == info["first_token_time"] - info["arrival_time"]
    assert engine.release_request("llama", handle) == AsStatus.ALLSPARK_SUCCESS


@REDO_SPOILED
def test_waiting_request_is_init_and_sync_waits(served_llama, tmp_path):
    from helpers import start_engine
    _, loader = served_llama
    engine = start_engine(loader, "one", max_batch=1, max_length=LONG_RUN_MAX_LENGTH)
    gen = {"top_k": 1, "max_new_tokens": LONG_RUN_TOKENS, "eos_token_id": []}
    for _ in range(3):
        _, h1, q1 = engine.start_request("one", {"input_ids": random_prompt(8, 1)}, gen)
        _, h2, q2 = engine.start_request("one", {"input_ids": random_prompt(8, 2)}, dict(gen, max_new_tokens=3))
        seen = [q2.GenerateStatus(), engine.get_as_engine_stat("one").pendding_request]
        synced = []
        syncer = threading.Thread(target=lambda: synced.append(engine.sync_request("one", h2)))
        syncer.start()
        time.sleep(0.2)
        seen += [list(synced), q2.GenerateStatus()]
        if not q1.GenerateStatus().is_terminal:
            break
        # the first ran its whole length meanwhile: this process stalled that long, and nothing above says
        # anything; again
        syncer.join(HANG_S)
        for h in (h1, h2):
            assert engine.release_request("one", h) == AsStatus.ALLSPARK_SUCCESS
    else:
        raise PremiseSpoiled("the first request ran to its end before the second was looked at, 3 times: stalled "
                             "process")
    # max_batch=1: the second waits for the first, and so does a sync_request on it
    init_status, pending, synced_then, status_then = seen
    assert init_status == S.Init and pending >= 1
    assert not synced_then, "sync_request returned while its request was still waiting"
    assert status_then == S.Init
    assert engine.stop_request("one", h1) == AsStatus.ALLSPARK_SUCCESS      # frees the one batch slot
    syncer.join(HANG_S)
    assert synced == [AsStatus.ALLSPARK_SUCCESS]
    assert q1.GenerateStatus() == S.GenerateFinished and q2.GenerateStatus() == S.GenerateFinished
    assert len(q2.GetNoWait().ids_from_generate) == 3
    assert engine.sync_request("one", None) == AsStatus.ALLSPARK_SUCCESS
    for h in (h1, h2):
        assert engine.release_request("one", h) == AsStatus.ALLSPARK_SUCCESS
    assert engine.stop_model("one") == 0 and engine.release_model("one") == 0


def test_length_eos_and_stop_words(served_llama, llama):
    engine, _ = served_llama
    prompt = random_prompt(10, seed=6)
    ref = hf_greedy(llama.model, prompt, 20)
    # max_length counts the prompt: 10 + 5
    assert generate(engine, "llama", prompt, {"top_k": 1, "max_length": 15, "eos_token_id": []})[0] == ref[:5]
    # max_new_tokens tighter than max_length wins
    assert generate(engine, "llama", prompt, {"top_k": 1, "max_length": 200, "max_new_tokens": 4,
                                              "eos_token_id": []})[0] == ref[:4]
    # eos: generation stops at (and includes) the first eos token
    k = 6
    eos = ref[k]
    first = ref.index(eos)
    out = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 20, "eos_token_id": [eos, 3]})[0]
    assert out == ref[:first + 1]
    # stop words: a two-token sequence from the reference
    seq = ref[8:10]
    stop_at = next(i for i in range(1, 20) if ref[i - 1:i + 1] == seq)
    out = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 20, "eos_token_id": [],
                                             "stop_words_ids": [[511, 510], seq]})[0]
    assert out == ref[:stop_at + 1]


def test_reference_builders_fill_model_defaults(served_llama, llama):
    engine, loader = served_llama
    rt = loader.create_reference_runtime_config_builder("x", "cpu", [0], max_batch=4).max_length(256).build()
    assert rt.engine_max_length == 256 and rt.engine_max_batch == 4 and rt.compute_unit == "CPU:0"
    gen = loader.create_reference_generation_config_builder(rt).update({"top_k": 1}).build()
    assert gen["eos_token_id"] == [1] and gen["max_length"] == 256       # from config.json / the runtime cfg
    prompt = random_prompt(12, seed=8)
    status, handle, queue = engine.start_request_ids("llama", loader, prompt, gen)
    tokens, _, _ = collect(queue)
    engine.release_request("llama", handle)
    ref = hf_greedy(llama.model, prompt, len(tokens))
    assert_same_tokens(tokens, ref)
    assert len(tokens) == 256 - 12 or tokens[-1] == 1


def test_engine_stat_info_version(served_llama):
    engine, _ = served_llama
    stat = engine.get_as_engine_stat("llama")
    assert stat.model_name == "llama" and stat.span_size == 16
    assert stat.total_token == stat.total_span * 16 and stat.free_span + stat.used_span == stat.total_span
    assert stat.total_generated_token > 0 and stat.total_prefill_token > 0
    assert "free_token=" in stat.ToString() and stat.dict()["pendding_request"] == stat.pending_request
    info = json.loads(engine.get_model_info("llama"))
    assert info["architecture"] == "LlamaForCausalLM" and info["dtype"] == "float32" and info["started"]
    assert re.fullmatch(r"\d+\.\d+\.\d+/\(GitSha1:[^)]+\)/\(Build:[^)]+\)", engine.get_version_full())
    assert engine.get_rank_id() == 0 and engine.is_allspark_work_as_service() is False


def test_kernel_isa_is_resolved_at_install(served_llama):
    """The ISA is resolved at install (py-cpuinfo, where it is the source, takes ~1.5 s), not in the first TTFT."""
    from helpers import start_engine

    from allspark_server import Engine
    from allspark_server.compute import ops
    _, loader = served_llama
    ops.isa_level.cache_clear()
    engine = start_engine(loader, "llama", engine=Engine())
    try:
        assert ops.isa_level.cache_info().currsize == 1
    finally:
        assert engine.stop_model("llama") == AsStatus.ALLSPARK_SUCCESS
        assert engine.release_model("llama") == AsStatus.ALLSPARK_SUCCESS


def test_allspark_client_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import allspark_client as c\n"
            "from allspark_client._proto import allspark_pb2\n"
            "q = c.ResultQueue(); assert q.GenerateStatus() == c.GenerateRequestStatus.Init\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_proto_stubs_match_proto(tmp_path):
    """The committed generated code is what proto/generate.py makes from proto/allspark.proto today."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, os.path.join(root, "proto", "generate.py"), str(tmp_path)], check=True)
    for name in ("allspark_pb2.py", "allspark_pb2.pyi", "allspark_pb2_grpc.py"):
        with open(os.path.join(root, "allspark_client", "_proto", name)) as a, open(tmp_path / name) as b:
            assert a.read() == b.read(), f"{name} is stale: run python proto/generate.py"
