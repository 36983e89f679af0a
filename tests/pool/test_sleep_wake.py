"""Sleep and wake (unload_device_mem / load_device_mem). On a CPU Engine: greedy tokens before and after a sleep
and wake equal transformers' (the prefix cache's spans were forgotten, the weights read again), the process's RSS
drops by most of the weights' bytes while asleep, requests are refused with ALLSPARK_REQUEST_DENIED and running ones
end GenerateInterrupted saying why; a second sleep or a wake of an awake model does nothing. On a 2-rank pool through
ClientEngine: the same greedy and refusal checks. On a GPU (marker `gpu`): torch.cuda.mem_get_info shows at least 95%
of what install_model + start_model took free again while asleep, for either wake source, the greedy tokens equal
before and after, and the wake times print beside a fresh install_model + start_model's as JSON (`-s` shows them).
"""
from __future__ import annotations

import gc
import json
import time

import psutil
import pytest
import torch
from helpers import (
    LONG_RUN_MAX_LENGTH,
    LONG_RUN_TOKENS,
    collect,
    greedy,
    hf_greedy,
    hf_ref,
    installed_on_pool,
    random_prompt,
    serialize,
    start_engine,
)
from pool_helpers import REDO_SPOILED, PremiseSpoiled, ran_out

from allspark_client.types import AsException, AsStatus, GenerateRequestStatus, TargetDevice
from allspark_server import Engine

NAME = "sleepy"
VOCAB = 16384
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory):
    """An Engine serving a ~37 MB fp32 Llama (most of it the 16k-row embedding and head: weights enough for the RSS
    to show them), with the prefix cache on; its transformers model."""
    from allspark_server.loader.tiny_model import build_tiny_model
    hf_dir = str(tmp_path_factory.mktemp("sleepy_hf"))
    hf = build_tiny_model(hf_dir, "llama_gqa_llama3", seed=3, hidden_size=256, num_layers=2, intermediate_size=512,
                          vocab_size=VOCAB, max_position_embeddings=LONG_RUN_MAX_LENGTH, weight_scale=0.1,
                          tokenizer=False)
    loader = serialize(hf_dir, NAME, str(tmp_path_factory.mktemp("sleepy_as")))
    engine = start_engine(loader, NAME, max_batch=4, max_length=LONG_RUN_MAX_LENGTH)
    yield engine, hf
    engine.shutdown()


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_engine_sleeps_and_wakes_with_the_same_greedy_output(sleepy):
    engine, hf = sleepy
    prompt = random_prompt(40, seed=11, vocab=VOCAB)    # two and a half spans: two go to the prefix cache
    want = hf_greedy(hf, prompt, 12)
    assert greedy(engine, NAME, prompt, 12) == want
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    awake = rss()
    assert engine.unload_device_mem(NAME) is None
    asleep = rss()
    assert awake - asleep >= 0.8 * weight_bytes, (awake - asleep, weight_bytes)
    assert engine.get_as_engine_stat(NAME).asleep
    assert json.loads(engine.get_model_info(NAME))["asleep"]
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, {"top_k": 1, "max_new_tokens": 4})
    assert (status, handle, queue) == (AsStatus.ALLSPARK_REQUEST_DENIED, None, None)
    assert "asleep" in engine.get_last_error() and "load_device_mem" in engine.get_last_error()
    engine.unload_device_mem(NAME)                       # asleep already: nothing happens
    assert engine.load_device_mem(NAME) is None
    assert not engine.get_as_engine_stat(NAME).asleep
    # the same prompt again: a prefix cache that kept its spans would read the zeros the wake left there
    assert greedy(engine, NAME, prompt, 12) == want
    engine.load_device_mem(NAME)                         # awake already: nothing happens
    other = random_prompt(9, seed=12, vocab=VOCAB)
    assert greedy(engine, NAME, other, 8) == hf_greedy(hf, other, 8)


@REDO_SPOILED
def test_sleep_stops_running_requests(sleepy):
    engine, hf = sleepy
    gen = {"top_k": 1, "max_new_tokens": LONG_RUN_TOKENS, "eos_token_id": []}
    started = [engine.start_request(NAME, {"input_ids": random_prompt(n, seed=n, vocab=VOCAB)}, gen) for n in (5, 21)]
    assert all(status == AsStatus.ALLSPARK_SUCCESS for status, _, _ in started)
    for _, _, queue in started:
        assert queue.Get() is not None                  # generating
    engine.unload_device_mem(NAME)
    ended = [collect(queue) for _, _, queue in started]
    if any(ran_out(queue) for _, _, queue in started):     # this process stalled past a whole stream: again
        for _, handle, _ in started:
            engine.release_request(NAME, handle)
        engine.load_device_mem(NAME)
        raise PremiseSpoiled(f"a stream had all {LONG_RUN_TOKENS} tokens before unload_device_mem")
    for (_, handle, queue), (tokens, _, final) in zip(started, ended):
        assert final == GenerateRequestStatus.GenerateInterrupted, (final, queue.ErrorMessage())
        assert "went to sleep" in queue.ErrorMessage() and len(tokens) < LONG_RUN_TOKENS
        assert engine.release_request(NAME, handle) == AsStatus.ALLSPARK_SUCCESS
    stat = engine.get_as_engine_stat(NAME)
    assert (stat.asleep, stat.running_request, stat.used_span) == (True, 0, 0), stat
    engine.load_device_mem(NAME)
    prompt = random_prompt(21, seed=21, vocab=VOCAB)
    assert greedy(engine, NAME, prompt, 8) == hf_greedy(hf, prompt, 8)


def test_bad_sleep_calls_are_refused(sleepy):
    engine, _ = sleepy
    for kwargs, words in ((dict(wake_from="disk"), "wake_from must be one of"),
                          (dict(wake_from="host"), "CPU rank's weights are host memory already")):
        with pytest.raises(AsException) as info:
            engine.unload_device_mem(NAME, **kwargs)
        assert info.value.status == AsStatus.ALLSPARK_PARAM_ERROR and words in info.value.message
    for call in (engine.unload_device_mem, engine.load_device_mem):
        with pytest.raises(AsException) as info:
            call("no_such_model")
        assert info.value.status == AsStatus.ALLSPARK_PARAM_ERROR and "not installed" in info.value.message
    assert not engine.get_as_engine_stat(NAME).asleep


@REDO_SPOILED
def test_pool_sleeps_and_wakes_with_the_same_greedy_output(pool, llama):
    client, loader = pool
    name = "sleepy_pool"
    with installed_on_pool(client, loader, name, max_length=LONG_RUN_MAX_LENGTH, max_batch=2):
        prompt = random_prompt(37, seed=5)
        want = hf_ref(llama.model, prompt, 12)
        assert greedy(client, name, prompt, 12) == want
        status, handle, queue = client.start_request(name, {"input_ids": random_prompt(6, seed=6)},
                                                     {"top_k": 1, "max_new_tokens": LONG_RUN_TOKENS,
                                                      "eos_token_id": []})
        assert status == AsStatus.ALLSPARK_SUCCESS and queue.Get() is not None
        assert client.unload_device_mem(name) is None
        _, _, final = collect(queue)
        if ran_out(queue):     # the sleep came after the stream's last token: it says nothing about the code
            client.release_request(name, handle)
            raise PremiseSpoiled(f"the stream had all {LONG_RUN_TOKENS} tokens before unload_device_mem reached "
                                 "the pool")
        assert final == GenerateRequestStatus.GenerateInterrupted and "went to sleep" in queue.ErrorMessage()
        assert client.release_request(name, handle) == AsStatus.ALLSPARK_SUCCESS
        assert client.get_as_engine_stat(name).asleep
        status, _, _ = client.start_request(name, {"input_ids": prompt}, {"top_k": 1, "max_new_tokens": 2})
        assert status == AsStatus.ALLSPARK_REQUEST_DENIED and "asleep" in client.get_last_error()
        with pytest.raises(AsException) as info:
            client.unload_device_mem(name, wake_from="host")
        assert info.value.status == AsStatus.ALLSPARK_PARAM_ERROR
        assert client.load_device_mem(name) is None
        assert not client.get_as_engine_stat(name).asleep
        assert greedy(client, name, prompt, 12) == want


# ---- GPU ---------------------------------------------------------------------------------------------------------

# ~0.5 B parameters (1 GB in bf16) and a 512 MiB KV cache (max_batch 8 x max_length 2048)
GPU_SPEC = dict(hidden_size=2048, num_layers=8, intermediate_size=5632, num_heads=16, num_kv_heads=8, vocab_size=32000)


def _free(empty_cache: bool = False) -> int:
    """Free bytes on GPU 0 (the driver's count); `empty_cache`: after torch's cached free blocks went back, with
    cuBLAS's workspaces (one per stream that ran a GEMM, made again at the next one: one can sit in a segment of
    torch's cache that would otherwise go back too) and a released model's tensors (they wait for Python's cycle
    collector: the model refers to itself)."""
    torch.cuda.synchronize()
    if empty_cache:
        gc.collect()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(0)[0]


def _install(engine: Engine, loader, name: str) -> float:
    """install_model + start_model on GPU 0; their seconds."""
    cfg = (loader.create_reference_runtime_config_builder(name, TargetDevice.CUDA, [0], max_batch=8)
           .max_length(2048).kv_cache_span_size(16).build())
    t = time.perf_counter()
    engine.install_model(cfg)
    assert engine.start_model(name) == AsStatus.ALLSPARK_SUCCESS
    return time.perf_counter() - t


@pytest.mark.gpu
@needs_gpu
def test_gpu_sleep_frees_the_model_memory(tmp_path):
    """The model's memory: what install_model + start_model leave held on the GPU (torch's cache emptied, so only
    what the model holds counts), in a process that served the model once before, so that the kernels the CUDA
    context loads for it (Triton's, cuBLAS's: the process's, not the model's, and never unloaded) are in the
    baseline. Asleep, at least 95% of it is free again. The wake times print beside a fresh install's: the first
    (kernels compiled) and one in a process that has them."""
    from allspark_server.loader.tiny_model import build_tiny_model
    hf_dir, name = str(tmp_path / "hf"), "gpu_sleepy"
    hf = build_tiny_model(hf_dir, "llama_gqa_llama3", seed=0, max_position_embeddings=2048, weight_scale=0.02,
                          dtype="bfloat16", tokenizer=False, **GPU_SPEC)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    loader = serialize(hf_dir, name, str(tmp_path / "as"), dtype="bfloat16")
    prompt = random_prompt(100, seed=1, vocab=GPU_SPEC["vocab_size"])
    engine = Engine()
    report = {"install_first_s": _install(engine, loader, name)}
    want = greedy(engine, name, prompt, 32)
    assert engine.release_model(name) == AsStatus.ALLSPARK_SUCCESS
    free_before = _free(empty_cache=True)
    report["install_again_s"] = _install(engine, loader, name)
    free_installed = _free(empty_cache=True)
    model_bytes = free_before - free_installed
    report["model_mib"] = model_bytes / 2**20
    kv_bytes = json.loads(engine.get_model_info(name))["kv_cache_bytes"]
    assert model_bytes >= weight_bytes + kv_bytes, (report, weight_bytes, kv_bytes)   # a baseline that saw it all
    assert greedy(engine, name, prompt, 32) == want
    for wake_from in ("host", "files"):
        engine.unload_device_mem(name, wake_from=wake_from)
        free_asleep = _free()
        assert engine.get_as_engine_stat(name).asleep
        report[f"held_asleep_{wake_from}_mib"] = (free_before - free_asleep) / 2**20
        report[f"freed_{wake_from}_fraction"] = (free_asleep - free_installed) / model_bytes
        t = time.perf_counter()
        engine.load_device_mem(name)
        report[f"wake_{wake_from}_s"] = time.perf_counter() - t
        assert free_asleep - free_installed >= 0.95 * model_bytes, report
        assert greedy(engine, name, prompt, 32) == want, wake_from
    engine.shutdown()
    print("sleep_wake_gpu " + json.dumps({k: round(v, 4) for k, v in report.items()}))
