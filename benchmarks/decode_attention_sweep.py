"""Launch-shape sweep of the GPU decode attention kernel (cuda/decode_attention.py) at large batches.

For each shape (batch, heads, kv heads, context) it times the decode attention over a bf16 span cache with
every (BLOCK_N, num_warps, num_stages, splits) of a small grid (paged_decode_attention's `launch` override),
CUDA-graph replays of 20 launches, and reports the KV bytes read per second of each; the fastest first. Diagnostic,
for choosing the defaults: `python benchmarks/decode_attention_sweep.py [--json PATH]`. --smoke: one small shape and
two launch shapes (the default among them); without a GPU in Triton's interpreter on CPU tensors, timed by the wall
clock (it checks that the script runs; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import itertools
import time

import common
import torch
from cuda_common import device  # first: it sets Triton's interpreter without a GPU

from allspark_server.compute.cuda import decode_attention as D

SHAPES = ((128, 32, 32, 192), (128, 32, 32, 256), (64, 32, 32, 192), (16, 32, 32, 192), (128, 32, 8, 192))
SMOKE_SHAPES = ((2, 4, 2, 40),)
DEFAULT = dict(block_n=D.DECODE_BLOCK_N, warps=4, stages=3, splits=1)


def launch(q, k, v, spans, ctx, out, block_n, warps, stages, splits):
    D.paged_decode_attention(q, k, v, spans, ctx, 0.088, num_splits=splits, out=out,
                             launch=dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages))


def time_ms(fn, reps: int = 20) -> float:
    if device() != "cuda":
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def sweep(batch: int, heads: int, kvh: int, ctx_len: int, d: int = 128, p: int = 32, smoke: bool = False) -> list[dict]:
    per_seq = -(-ctx_len // p)
    spans_n = batch * per_seq + 1
    dev = device()
    k = torch.randn(spans_n, p, kvh, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    spans = torch.randperm(spans_n - 1, device=dev)[:batch * per_seq].view(batch, per_seq).contiguous()
    ctx = torch.full((batch,), ctx_len, device=dev, dtype=torch.long)
    q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = D.paged_decode_attention(q, k, v, spans, ctx, 0.088)
    kv_bytes = 2 * batch * ctx_len * kvh * d * 2
    rows = []
    split_options = (1,) if batch * kvh >= 2048 else (1, 2)
    grid = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), split_options)
    if smoke:
        grid = [tuple(DEFAULT.values()), (32, 2, 2, max(split_options))]
    for block_n, warps, stages, splits in grid:
        try:
            fn = lambda: launch(q, k, v, spans, ctx, out, block_n, warps, stages, splits)  # noqa: E731
            fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = time_ms(fn)
        except Exception as e:   # a shape the compiler refuses (shared memory)
            rows.append({"block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "error": str(e)[:100]})
            continue
        rows.append({"block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "ms": ms,
                     "tbs": kv_bytes / ms / 1e9, "max_err": err})
    return sorted(rows, key=lambda r: r.get("ms", 1e9))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one small shape, two launch shapes (see the docstring)")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/decode-attention-sweep-<machine>.json "
                    "(--smoke: under results/quick/)")
    a = ap.parse_args(argv)
    if device() != "cuda" and not a.smoke:
        raise SystemExit("decode_attention_sweep.py needs a GPU (--smoke runs without one)")
    a.json = a.json or common.result_path("decode-attention-sweep", device(), a.smoke)
    report = {}
    for shape in SMOKE_SHAPES if a.smoke else SHAPES:
        rows = sweep(*shape, smoke=a.smoke)
        report["b%d_h%d_kvh%d_ctx%d" % shape] = rows
        default = next(r for r in rows if all(r.get(k) == v for k, v in DEFAULT.items()))
        print(shape, "best", rows[0], "default(64,4,3,1)", default, flush=True)
        common.write_report(a.json, report)


if __name__ == "__main__":
    main()
