"""Batch-1 decode attention on the CPU over bf16, int8 and uint4 span caches (the native kernels of
native/span_attention*.cpp), shaped like the 0.5 B benchmark model: 16 layers, 12 query heads, 4 KV heads,
head dim 128, spans of 32 tokens.

Two settings per context length:
- "streaming": every layer has its own cache, so the 16 calls read 16 x 2 x ctx x 4 x 128 values from memory,
  as a decode step does (the weights streamed between layers leave nothing of the cache behind);
- "in cache": one layer's cache attended 16 times, which shows the kernels' instruction cost alone.
The three cache modes run interleaved, one 16-layer pass each per round; the report is each mode's median time
and the median of its same-round ratio to bf16.

    PYTHONPATH=. python benchmarks/cpu_decode_attention.py [--contexts 256 2048] [--rounds 15] [--json PATH]

To compare two builds of the kernels, run it under each (alternating runs, same machine): on a shared VM only
ratios measured close together mean much.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

from allspark_server.compute import ops
from allspark_server.compute.steps import Attention
from allspark_server.quant import kv as kv_quant

LAYERS, SPAN, KV_HEADS, HEADS, HEAD_DIM = 16, 32, 4, 12, 128
MODES = ("bf16", "int8", "uint4")


def caches(ctx: int, layers: int, g: torch.Generator) -> dict:
    """Per mode, `layers` (k, v, k_param, v_param) caches holding ctx tokens in ctx / SPAN spans."""
    out = {m: [] for m in MODES}
    spans = -(-ctx // SPAN)
    for _ in range(layers):
        k = torch.randn(spans, SPAN, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        v = torch.randn(spans, SPAN, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        out["bf16"].append((k, v, None, None))
        for mode in MODES[1:]:
            (kc, kp), (vc, vp) = kv_quant.quantize_rows(k, mode), kv_quant.quantize_rows(v, mode)
            out[mode].append((kc, vc, kp, vp))
    return out


def measure(ctx: int, distinct_layers: int, rounds: int, g: torch.Generator) -> dict:
    cache = caches(ctx, distinct_layers, g)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=g).bfloat16()
    spans = torch.arange(-(-ctx // SPAN)).reshape(1, -1)
    lengths = torch.tensor([ctx])
    options = Attention(HEAD_DIM ** -0.5)

    def one_pass(mode: str) -> float:
        t0 = time.perf_counter()
        for k, v, kp, vp in cache[mode] * (LAYERS // distinct_layers):
            ops.decode_attention(q, k, v, spans, lengths, options, kp, vp)
        return time.perf_counter() - t0

    for mode in MODES:   # warm-up
        one_pass(mode)
    times = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:   # each round starts with the next mode
            times[mode].append(one_pass(mode))
    return {mode: {"ms_per_step": 1e3 * statistics.median(times[mode]),
                   "bf16_over_this": statistics.median(b / t for b, t in zip(times["bf16"], times[mode]))}
            for mode in MODES}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="default: benchmarks/results/cpu-attention-<machine>.json")
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("cpu-attention")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    report = {"kernels": ops.describe(), "threads": a.threads, "rounds": a.rounds, "results": {}}
    print(f"{report['kernels']}, {a.threads} threads, {a.rounds} rounds; ms per 16-layer decode step")
    for ctx in a.contexts:
        for setting, distinct in (("streaming", LAYERS), ("in cache", 1)):
            row = measure(ctx, distinct, a.rounds, g)
            report["results"][f"{ctx} {setting}"] = row
            print(f"ctx {ctx:5d} {setting:9s} " + "  ".join(
                f"{m} {row[m]['ms_per_step']:6.3f} ms ({row[m]['bf16_over_this']:.2f}x)" for m in MODES))
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
