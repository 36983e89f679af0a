"""Launch-shape sweep of the GPU decode attention kernel (cuda/attention_kernels.py) at large batches.

For each shape (batch, heads, kv heads, context) it times `_decode_kernel` over a bf16 span cache with every
(BLOCK_N, num_warps, num_stages, splits) of a small grid, CUDA-graph replays of 20 launches, and reports the
KV bytes read per second of each; the fastest first. Diagnostic, for choosing the defaults:
`python benchmarks/decode_attention_sweep.py --json OUT.json`.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from allspark_server.cuda import attention_kernels as A


def launch(q, k, v, spans, ctx, out, parts, block_n, warps, stages, splits):
    b, h, d = q.shape
    kvh = k.shape[2]
    m_part, l_part, acc_part = parts if splits > 1 else (out, out, out)
    tiles = A._tile_config(d, k.dtype)
    A._decode_kernel[(b, kvh, splits)](
        q, k, v, k, v, spans, ctx, ctx, out, m_part, l_part, acc_part, 0.088 * A.LOG2_E, h,
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3], 0, 0, 0, spans.stride(0), out.stride(0),
        out.stride(1), G=h // kvh, P=k.shape[1], D=d, NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(h // kvh)),
        BLOCK_N=block_n, HAS_ALIBI=False, QUANT=0, num_warps=warps, num_stages=stages, **tiles)
    if splits > 1:
        A._combine_kernel[(b, h)](m_part, l_part, acc_part, out, out.stride(0), out.stride(1), h, D=d,
                                  NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=tiles["BLOCK_D"])


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
    ref = A.paged_decode_attention(q, k, v, spans, ctx, 0.088)
    kv_bytes = 2 * batch * ctx_len * kvh * d * 2
    rows = []
    split_options = (1,) if batch * kvh >= 2048 else (1, 2)
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), split_options):
        parts = (torch.empty(batch, heads, splits, device="cuda"), torch.empty(batch, heads, splits, device="cuda"),
                 torch.empty(batch, heads, splits, d, device="cuda"))
        try:
            fn = lambda: launch(q, k, v, spans, ctx, out, parts, block_n, warps, stages, splits)  # noqa: E731
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
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    report = {}
    for shape in ((128, 32, 32, 192), (128, 32, 32, 256), (64, 32, 32, 192), (16, 32, 32, 192), (128, 32, 8, 192)):
        rows = sweep(*shape)
        report["b%d_h%d_kvh%d_ctx%d" % shape] = rows
        default = next(r for r in rows if r.get("block_n") == A.DECODE_BLOCK_N and r.get("warps") == 4
                       and r.get("stages") == 3 and r.get("splits") == 1)
        print(shape, "best", rows[0], "default(64,4,3,1)", default, flush=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
