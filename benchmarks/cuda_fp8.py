"""FP8 on one GPU against bf16, on the random Llama-2-7B-shaped model of the GPU benchmark (cuda_common.py):

    python benchmarks/cuda_fp8.py [--layers 32] [--rounds 3] [--variants fp8_e4m3+head int8+head] [--ab-silu]
                                  [--kv [--kv-batch 32 --kv-context 4096]] [--w8a8 [--w8a8-batch 128]] [--no-b1]
                                  [--smoke]

Batch-1 decode of each quantized variant (cuda_rows.quant_rows: the same Engine, rounds interleaved with the bf16
model, greedy agreement with bf16 over 16 tokens, each step's weight bytes, graph replay time and the kernels of
one step). --kv: bf16 against fp8 KV spans at --kv-batch requests of --kv-context tokens (kv_rows). --w8a8: bf16
against fp8 weights with fp8 activations at --w8a8-batch concurrent requests (w8a8_rows). --smoke: two
narrow layers and one round (checks that it runs; needs a GPU of compute capability 8.9+ for fp8). Writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
import torch
import workloads as W
from cuda_common import (
    LLAMA2_7B,
    bench_root,
    bench_shape,
    build_model,
    copy_bandwidth_gbs,
    first_divergence,
    free_memory,
    graph_replay_ms,
    kernel_breakdown,
    kv_bytes_per_token,
    quantized_bench_model,
    serialized_bench_model,
)
from cuda_rows import quant_rows

PROMPT_LEN = 32


def kv_row_bytes_per_token(shape: dict, mode: str) -> int:
    """Bytes of K and V one token takes in every layer's spans of `mode` ("default": bf16; codes and params
    otherwise, as the engine sizes them)."""
    from allspark_server.quant import kv as kv_quant
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    row = kv_quant.bytes_per_row(None if mode == "default" else mode, head_dim, torch.bfloat16)
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * row


def concurrent_run(engine, name: str, cfg, prompts: list[list[int]], new: int, out: dict, key: str,
                   first: bool) -> float:
    """Installs `cfg`, runs `prompts` together for `new` tokens each, each read by a thread of its own, and
    releases it: the decode-only tokens/s (workloads.decode_only_tps). Also into `out`: the same requests read on
    one asyncio loop, as the HTTP server reads its streams (key + "_one_loop_tps": threads woken every step share
    the GIL with the engine's), the decode graph's replay at their batch (key + "_graph_replay_ms"), and on the
    first round the first prompt's greedy tokens (key + "_greedy")."""
    engine.install_model(cfg)
    engine.start_model(name)
    tps = W.decode_only_tps(W.token_times_threads(engine, name, prompts, new))
    one_loop = W.decode_only_tps(W.token_times_one_loop(engine, name, prompts, new))
    out.setdefault(f"{key}_one_loop_tps", []).append(one_loop)
    runner = engine._engine.models[name].runner
    out.setdefault(f"{key}_graph_replay_ms", []).append(graph_replay_ms(runner.graphs, len(prompts)))
    if first:
        out[f"{key}_greedy"] = W.greedy_tokens(engine, name, prompts[0], 16)
    del runner
    engine.stop_model(name)
    engine.release_model(name)
    free_memory()
    return tps


def compared(out: dict, runs: dict, new: str, base: str, prefix: str) -> dict:
    """`out` (concurrent_run's keys for both) with the medians of same-round ratios `new` / `base`: decode
    tokens/s read by threads (prefix + "_decode") and on one loop ("_decode_one_loop"), the graph's speed
    ("_graph"); and the first greedy token where they differ."""
    def median_ratio(a: list, b: list) -> float:
        return statistics.median(x / y for x, y in zip(a, b))
    out["decode_tps_by_round"] = runs
    out[f"{prefix}_decode"] = median_ratio(runs[new], runs[base])
    out[f"{prefix}_decode_one_loop"] = median_ratio(out[f"{new}_one_loop_tps"], out[f"{base}_one_loop_tps"])
    out[f"{prefix}_graph"] = median_ratio(out[f"{base}_graph_replay_ms"], out[f"{new}_graph_replay_ms"])
    out["greedy_first_divergence"] = first_divergence(out.pop(f"{base}_greedy"), out.pop(f"{new}_greedy"))
    return out


def kv_rows(engine, loader, shape: dict, batch: int, context: int, new: int, rounds: int) -> dict:
    """`batch` requests of `context` prompt tokens then `new` tokens each, submitted together, on bf16 spans and
    on fp8 spans (kv_cache_mode "fp8"; each installed alone, the rounds alternating): decode-only tokens/s (tokens
    after the last request's first over the time from then on), the decode graph's replay at `batch` rows over
    the last step's contexts, and greedy agreement of the first request's tokens with bf16's."""
    vocab = LLAMA2_7B["vocab_size"]
    max_len = context + new + 32
    prompts = [W.prompt(context, 900 + i, vocab) for i in range(batch)]
    runs: dict = {"default": [], "fp8": []}
    out: dict = {"batch": batch, "context": context, "new_tokens": new}
    for r in range(rounds):
        for mode in runs:
            name = f"bench-kv-{mode}"
            per_token = kv_row_bytes_per_token(shape, mode)
            cfg = (loader.create_reference_runtime_config_builder(name, "cuda", [0], max_batch=batch)
                   .max_length(max_len).kv_cache_span_size(32).kv_cache_mode(mode)
                   .kv_cache_memory(batch * (max_len + 64) * per_token).prefill_cache(False).build())
            runs[mode].append(concurrent_run(engine, name, cfg, prompts, new, out, mode, r == 0))
    return compared(out, runs, "fp8", "default", "fp8_vs_bf16")


def w8a8_rows(engine, loader, root: str, shape: dict, batch: int, new: int, rounds: int) -> dict:
    """`batch` requests of PROMPT_LEN prompt tokens then `new` tokens each, submitted together, on the bf16 model
    and on its fp8 copy with fp8 activations (W8A8: `fp8_e4m3+a8`; each installed alone, the rounds alternating):
    decode-only tokens/s as kv_rows counts them, the decode graph's replay at `batch` rows, and greedy agreement
    of the first request's tokens with bf16's."""
    vocab = LLAMA2_7B["vocab_size"]
    max_len = PROMPT_LEN + new + 32
    prompts = [W.prompt(PROMPT_LEN, 700 + i, vocab) for i in range(batch)]
    variant = "fp8_e4m3+a8"
    loaders = {"bfloat16": loader, variant: quantized_bench_model(root, variant)}
    runs: dict = {m: [] for m in loaders}
    out: dict = {"batch": batch, "prompt_len": PROMPT_LEN, "new_tokens": new, "variant": variant}
    for r in range(rounds):
        for mode, source in loaders.items():
            name = f"bench-w8a8-{mode}"
            cfg = (source.create_reference_runtime_config_builder(name, "cuda", [0], max_batch=batch)
                   .max_length(max_len).kv_cache_span_size(32)
                   .kv_cache_memory(batch * (max_len + 64) * kv_bytes_per_token(shape)).prefill_cache(False).build())
            runs[mode].append(concurrent_run(engine, name, cfg, prompts, new, out, mode, r == 0))
    return compared(out, runs, variant, "bfloat16", "w8a8_vs_bf16")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=LLAMA2_7B["num_hidden_layers"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=["fp8_e4m3+head", "int8+head"],
                   help="InstantQuant variants (common.quant_variant's names)")
    p.add_argument("--ab-silu", action="store_true", help="the fp8 variant again with silu·mul a launch of its own "
                   "(fp8 out of cuda_ops.SILU_MUL_QUANT_FORMATS): the A/B of the gate_up GEMV's epilogue")
    p.add_argument("--kv", action="store_true", help="also the KV rows: --kv-batch requests of --kv-context prompt "
                   "tokens decoding together, bf16 spans against fp8 spans")
    p.add_argument("--kv-batch", type=int, default=32)
    p.add_argument("--kv-context", type=int, default=4096)
    p.add_argument("--kv-new", type=int, default=64)
    p.add_argument("--kv-rounds", type=int, default=2)
    p.add_argument("--w8a8", action="store_true", help="also W8A8 (fp8 weights and activations) against bf16 at "
                   "--w8a8-batch concurrent requests of --new-tokens tokens")
    p.add_argument("--w8a8-batch", type=int, default=128)
    p.add_argument("--no-b1", action="store_true", help="skip the batch-1 rows")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None, help="default: benchmarks/results/cuda-fp8-<machine>.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_fp8.py needs a GPU")
    from allspark_server import Engine
    shape = bench_shape(a.layers, a.smoke)
    rounds, new_tokens = (1, 8) if a.smoke else (a.rounds, a.new_tokens)
    root = bench_root(shape)
    t0 = time.perf_counter()
    build_model(root, shape)
    out = a.out or common.result_path("cuda-fp8", "cuda", a.smoke)
    report = {"device": torch.cuda.get_device_name(), "layers": shape["num_hidden_layers"],
              "copy_gbs": copy_bandwidth_gbs(256 << 20 if a.smoke else 2 << 30)}
    loader = serialized_bench_model(root)
    engine = Engine()
    if a.kv:
        report["kv"] = kv_rows(engine, loader, shape, a.kv_batch, 64 if a.smoke else a.kv_context,
                               4 if a.smoke else a.kv_new, 1 if a.smoke else a.kv_rounds)
        print(f"KV spans: {report['kv']}", flush=True)
        common.write_report(out, report)
    if a.w8a8:
        report["w8a8"] = w8a8_rows(engine, loader, root, shape, 4 if a.smoke else a.w8a8_batch, new_tokens,
                                   1 if a.smoke else max(2, rounds - 1))
        print(f"W8A8: {report['w8a8']}", flush=True)
        common.write_report(out, report)
    if a.no_b1:
        return report
    max_len = PROMPT_LEN + new_tokens + 64
    cfg = (loader.create_reference_runtime_config_builder("bench-cuda", "cuda", [0], max_batch=8)
           .max_length(max_len).kv_cache_span_size(32).kv_cache_memory(8 * max_len * kv_bytes_per_token(shape))
           .build())
    engine.install_model(cfg)
    engine.start_model("bench-cuda")
    report["setup_s"] = time.perf_counter() - t0
    runner = engine._engine.models["bench-cuda"].runner
    W.decode_tps(engine, "bench-cuda", LLAMA2_7B["vocab_size"], 8)
    report["bf16"] = {"graph_replay_ms_b1": graph_replay_ms(runner.graphs, 1),
                      "kernels_b1": kernel_breakdown(runner, 1, top=14)}
    del runner
    report["b1"] = quant_rows(engine, root, a.variants, PROMPT_LEN, new_tokens, rounds, max_len, shape,
                              breakdown=True)
    print(f"batch 1: {report['b1']}", flush=True)
    common.write_report(out, report)
    fp8 = [v for v in a.variants if v.startswith("fp8")]
    if a.ab_silu and fp8:
        from allspark_server.compute.cuda import cuda_ops
        fused = cuda_ops.SILU_MUL_QUANT_FORMATS
        cuda_ops.SILU_MUL_QUANT_FORMATS = tuple(f for f in fused if f != "fp8_e4m3")
        try:
            report["b1_silu_unfused"] = quant_rows(engine, root, fp8[:1], PROMPT_LEN, new_tokens, rounds, max_len,
                                                   shape, breakdown=True)
        finally:
            cuda_ops.SILU_MUL_QUANT_FORMATS = fused
        print(f"batch 1, silu·mul unfused: {report['b1_silu_unfused']}", flush=True)
        common.write_report(out, report)
    engine.stop_model("bench-cuda")
    engine.release_model("bench-cuda")
    return report


if __name__ == "__main__":
    main()
