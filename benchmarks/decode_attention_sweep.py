"""Launch-shape sweep of the GPU decode attention kernel (cuda/decode_attention.py) at large batches.

For each shape (batch, heads, kv heads, context) it times the decode attention over a bf16 span cache with
every (BLOCK_N, num_warps, num_stages, splits) of a small grid (paged_decode_attention's `launch` override),
CUDA-graph replays of 20 launches, and reports the KV bytes read per second of each; the fastest first. Diagnostic, for choosing the defaults:
`python benchmarks/decode_attention_sweep.py [--json PATH]`.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

import common
from allspark_server.compute.cuda import decode_attention as D


def launch(q, k, v, spans, ctx, out, block_n, warps, stages, splits):
    D.paged_decode_attention(q, k, v, spans, ctx, 0.088, num_splits=splits, out=out,
                             launch=dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages))


def time_ms(fn, reps: int = 20) -> float:
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


def sweep(batch: int, heads: int, kvh: int, ctx_len: int, d: int = 128, p: int = 32) -> list[dict]:
    per_seq = -(-ctx_len // p)
    spans_n = batch * per_seq + 1
    k = torch.randn(spans_n, p, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    spans = torch.randperm(spans_n - 1, device="cuda")[:batch * per_seq].view(batch, per_seq).contiguous()
    ctx = torch.full((batch,), ctx_len, device="cuda", dtype=torch.long)
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = D.paged_decode_attention(q, k, v, spans, ctx, 0.088)
    kv_bytes = 2 * batch * ctx_len * kvh * d * 2
    rows = []
    split_options = (1,) if batch * kvh >= 2048 else (1, 2)
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), split_options):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="default: benchmarks/results/decode-attention-sweep-<machine>.json")
    a = ap.parse_args()
    a.json = a.json or common.result_path("decode-attention-sweep", "cuda")
    report = {}
    for shape in ((128, 32, 32, 192), (128, 32, 32, 256), (64, 32, 32, 192), (16, 32, 32, 192), (128, 32, 8, 192)):
        rows = sweep(*shape)
        report["b%d_h%d_kvh%d_ctx%d" % shape] = rows
        default = next(r for r in rows if r.get("block_n") == D.DECODE_BLOCK_N and r.get("warps") == 4
                       and r.get("stages") == 3 and r.get("splits") == 1)
        print(shape, "best", rows[0], "default(64,4,3,1)", default, flush=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
