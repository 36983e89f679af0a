"""The GPU benchmark's rows after batch 1: TTFT, quantized weights, the 2-GPU pool, concurrency and Poisson
arrivals, each against its peer (transformers, the bf16 model, one GPU, the PyTorch CUDA-graph step).

cuda_bench.py runs them in order on one Engine holding the benchmark model ("bench-cuda"); cuda_common.py holds
the model's shape and the timing helpers.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch_cuda_peer as peer_mod
import workloads as W
from cuda_common import (
    CONC_NEW,
    CONC_PROMPT,
    LLAMA2_7B,
    first_divergence,
    free_memory,
    graph_replay_ms,
    hf_generate_s,
    kernel_breakdown,
    kv_bytes_per_token,
    note_memory,
    overlap_off,
    quantized_bench_model,
    time_graph_steps,
)
from step_profile import StepProfile

from allspark_client import settings


def ttft_rows(engine, hf, lengths, repeats: int = 3) -> dict:
    """Time to the first token of a lone prompt of each length: the Engine (W.ttft) and transformers' generate
    of one token (synchronized), medians of `repeats`."""
    vocab = LLAMA2_7B["vocab_size"]
    out = {}
    for n in lengths:
        W.first_token_s(engine, "bench-cuda", W.ttft_prompt(n, 0, vocab, salt=2))   # warm-up (not a cached prefix)
        ours = W.ttft(engine, "bench-cuda", vocab, n, repeats)
        times = [hf_generate_s(hf, [W.prompt(n, 100 + r, vocab)], 1) for r in range(repeats + 1)]
        theirs = statistics.median(times[1:])                                    # the first warms up
        out[n] = {"allspark_s": ours, "hf_s": theirs, "hf_vs_allspark": theirs / ours}
    return out


def poisson_row(engine, num: int, rate: float = 16.0) -> dict:
    """`num` requests (128 in / 128 out) arriving as a Poisson process of `rate`/s: TTFT and TPOT median and p99,
    output tokens/s (workloads.poisson)."""
    return dict(W.poisson(engine, "bench-cuda", LLAMA2_7B["vocab_size"], num, rate, CONC_PROMPT, CONC_NEW),
                rate_rps=rate, requests=num)


def quant_rows(engine, root: str, variants: list[str], prompt_len: int, new_tokens: int, rounds: int,
               max_len: int, shape: dict, breakdown: bool = False) -> dict:
    """The same weights quantized with InstantQuant (int8 per channel, int4_g128, ...) served by the same Engine
    next to the bf16 model, one variant at a time (two beside transformers, the bf16 model and its KV cache do
    not fit an H100): batch-1 decode interleaved round by round with bf16's, each with its weight bytes per
    token; greedy agreement with bf16 over 16 tokens."""
    from allspark_server.runner.memory_bandwidth import decode_weight_bytes
    vocab = LLAMA2_7B["vocab_size"]
    prompt = W.prompt(prompt_len, 0, vocab)
    bf16 = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
    out, by_round = {}, {}
    for v in variants:
        name = f"bench-cuda-{v}"
        t = time.perf_counter()
        q = quantized_bench_model(root, v)
        kv_bytes = 8 * -(-max_len // 32) * 32 * kv_bytes_per_token(shape)     # 8 sequences
        builder = q.create_reference_runtime_config_builder(name, "cuda", [0], max_batch=8).max_length(max_len)
        builder = builder.kv_cache_span_size(32).kv_cache_memory(kv_bytes)
        engine.install_model(builder.build())
        engine.start_model(name)
        runner = engine._engine.models[name].runner
        out[v] = {"serialize_s": time.perf_counter() - t,
                  "weight_bytes_per_token": decode_weight_bytes(runner.model, runner.model.model.embed_tokens.weight),
                  "greedy_first_divergence_vs_bf16": first_divergence(bf16, W.greedy_tokens(engine, name, prompt, 16))}
        W.decode_tps(engine, name, vocab, 8)
        runs = by_round[v] = {"bfloat16": [], v: []}
        for r in range(rounds):
            for model, tps in (("bench-cuda", runs["bfloat16"]), (name, runs[v])):
                tps.append(W.decode_tps(engine, model, vocab, new_tokens, seed=r, prompt_len=prompt_len))
        out[v]["decode_b1_tps"] = statistics.median(runs[v])
        out[v]["vs_bf16"] = statistics.median(a / b for a, b in zip(runs[v], runs["bfloat16"]))
        out[v]["graph_replay_ms_b1"] = graph_replay_ms(runner.graphs, 1)
        if breakdown:
            out[v]["kernels_b1"] = kernel_breakdown(runner, 1, top=14)
        engine.stop_model(name)
        engine.release_model(name)
        del runner
        free_memory()
    out["decode_b1_tps_by_round"] = by_round
    return out


def two_gpu_pool_rows(engine, loader, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    """2-rank pools (ClientEngine, GPUs 0 and 1, NCCL) against the single-GPU Engine: batch-1 decode interleaved
    round by round, with a pool stepping one step at a time and one with overlapped scheduling
    (ALLSPARK_OVERLAP=0 / 1), whether their greedy tokens agree with one GPU's, and each rank's graph replay
    alone (pool_step_micro.py)."""
    from allspark_client import ClientEngine
    vocab = LLAMA2_7B["vocab_size"]
    pools = {}
    try:
        for name, overlap in (("pool_2gpu", "0"), ("pool_2gpu_overlap", "1")):
            with settings.override(OVERLAP=overlap):   # the ranks inherit mpirun's environment
                pools[name] = ClientEngine(ranks=2)
            cfg = (loader.create_reference_runtime_config_builder("bench-pool", "cuda", [0, 1], max_batch=8)
                   .max_length(prompt_len + new_tokens + 16).kv_cache_span_size(32).build())
            pools[name].install_model(cfg)
            pools[name].start_model("bench-pool")
        prompt = W.prompt(prompt_len, 0, vocab)
        one = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
        out = {}
        for name, client in pools.items():
            theirs = W.greedy_tokens(client, "bench-pool", prompt, 16)
            out[f"{name}_greedy_first_divergence_vs_1gpu"] = first_divergence(one, theirs)
            W.decode_tps(client, "bench-pool", vocab, 8)
        runs = {"engine_1gpu": [], **{name: [] for name in pools}}
        sides = [("engine_1gpu", engine, "bench-cuda")] + [(n, client, "bench-pool") for n, client in pools.items()]
        for r in range(rounds):
            for name, e, model in sides:
                runs[name].append(W.decode_tps(e, model, vocab, new_tokens, seed=r, prompt_len=prompt_len))
        out["decode_b1_tps_by_round"] = runs
        for name in pools:
            out[f"{name}_decode_b1_tps"] = statistics.median(runs[name])
            out[f"{name}_vs_1gpu"] = statistics.median(a / b for a, b in zip(runs[name], runs["engine_1gpu"]))
    finally:
        for client in pools.values():
            client.close()
    out["graph_replay"] = pool_graph_replay(loader)
    return out


def pool_graph_replay(loader) -> dict:
    """Each rank's batch-1 decode graph of a 2-rank pool replayed alone (pool_step_micro.py under mpirun)."""
    import json
    import subprocess
    import tempfile

    from allspark_client.launch.launcher import find_mpirun
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "micro.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [find_mpirun("mpirun"), "-n", "2", "--bind-to", "none", sys.executable,
               os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_step_micro.py"),
               loader.graph_path, loader.weights_path, out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-2000:]}
        with open(out) as f:
            return json.load(f)


def engine_concurrent(engine, num: int, one_loop: bool = False) -> dict:
    """`num` requests of CONC_PROMPT in / CONC_NEW out submitted together: output tokens/s over the whole run and
    decode-only (tokens after the last request's first token over the time from then to the end), with the
    step profile and the GPU time of the decode steps of all `num` rows. Each request is read by a thread of its
    own blocked in Get() (DashInfer's examples), or with `one_loop` all on one asyncio loop as the HTTP server
    reads them (workloads.token_times_one_loop): the engine thread shares the GIL with every woken reader."""
    vocab = LLAMA2_7B["vocab_size"]
    served = engine._engine.models["bench-cuda"]
    profile = StepProfile(served)
    graph_ms = time_graph_steps(served.runner.graphs, num)
    prompts = [W.prompt(CONC_PROMPT, 500 + i, vocab) for i in range(num)]
    read = W.token_times_one_loop if one_loop else W.token_times_threads
    t0 = time.perf_counter()
    stamps = read(engine, "bench-cuda", prompts, CONC_NEW)
    end = max(s[-1] for s in stamps)
    all_first = max(s[0] for s in stamps)
    profile.restore()
    return {"allspark_tps": num * CONC_NEW / (end - t0),
            "allspark_decode_tps": W.decode_only_tps(stamps),
            "first_tokens_s": all_first - t0, "steps": profile.summary(),
            f"graph_step_gpu_ms_b{num}": graph_ms()}


def concurrent_rows(engine, hf, weights, num: int) -> dict:
    """`num` requests of 128 in / 128 out submitted together to the Engine (output tokens/s over the whole
    run, and decode-only: tokens after the last request's first token over the time from then to the end),
    the peer's decode-only rate at batch `num` (graph replay) and transformers' static batch (generate)."""
    vocab = LLAMA2_7B["vocab_size"]
    served = engine._engine.models["bench-cuda"]
    row = engine_concurrent(engine, num)
    if num == 128:   # what overlapped scheduling gives here: the same run with it off
        with overlap_off(served):
            off = engine_concurrent(engine, num)
        row["no_overlap"] = {k: off[k] for k in ("allspark_tps", "allspark_decode_tps", "steps")}
    # the same requests read on one asyncio loop (the HTTP server's way): how much of the row is the readers' GIL
    loop = engine_concurrent(engine, num, one_loop=True)
    row["one_loop_readers"] = {k: loop[k] for k in ("allspark_tps", "allspark_decode_tps", "steps")}
    graphs = served.runner.graphs
    size = next(s for s in graphs.sizes if s >= num)
    row["graph_replay_ms"] = graph_replay_ms(graphs, size)
    row["kernels_top"] = kernel_breakdown(served.runner, size)
    free_memory()
    note_memory(f"c{num} engine")
    peer = peer_mod.StaticLlama(weights, batch=num, max_len=CONC_PROMPT + CONC_NEW + 8)
    peer.prefill_by_decoding(W.prompt(CONC_PROMPT, 500, vocab))
    peer.capture()
    row["torch_cuda_graph_decode_tps"] = peer.decode_tps(CONC_PROMPT, CONC_NEW)
    del peer
    free_memory()
    note_memory(f"c{num} peer freed")
    batch = [W.prompt(CONC_PROMPT, 500 + i, vocab) for i in range(num)]
    row["hf_static_batch_tps"] = num * CONC_NEW / hf_generate_s(hf, batch, CONC_NEW)
    free_memory()
    note_memory(f"c{num} hf generate")
    row["allspark_decode_vs_torch_cuda_graph"] = row["allspark_decode_tps"] / row["torch_cuda_graph_decode_tps"]
    row["allspark_vs_hf_static"] = row["allspark_tps"] / row["hf_static_batch_tps"]
    row["one_loop_readers"]["decode_vs_torch_cuda_graph"] = (row["one_loop_readers"]["allspark_decode_tps"]
                                                             / row["torch_cuda_graph_decode_tps"])
    return row
