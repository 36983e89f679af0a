"""A prompt chunk's causal attention on the CPU: the native kernel (native/prefill_attention.cpp) against ATen's
scaled_dot_product_attention over the same context gathered from the span cache (what compute/reference.py runs),
one layer of the CPU benchmark model's heads (12 query heads over 4 KV heads, head dim 128), the chunk starting at
position 0, per prompt length and dtype. Interleaved: each round times both, each over `--reps` calls; reported: the
median ms of each and the median of the rounds' ratios (SDPA's time / the kernel's), with the kernel's GFLOP/s
(4 H D n^2 / 2: the causal half of QK and PV). Needs AVX2 or AVX-512.

    PYTHONPATH=. python benchmarks/prefill_attention_micro.py [--lengths 128 512 2048] [--rounds 5] [--threads 2]
        [--as-avx2] [--json PATH]

--as-avx2 runs the kernel's AVX2 code (ISA level 1) and ATen capped at AVX2 (common.AVX2_CAPS, set before torch
loads): an indication for AVX2-only machines from a newer one; their own cores' rates differ.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common

common.as_avx2_if_asked()   # before torch loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gemv_quant_micro import interleaved_times  # noqa: E402

from allspark_server.compute import ops  # noqa: E402

H, KVH, D, SPAN = 12, 4, 128, 16


def case(n: int, dtype: torch.dtype, reps: int, rounds: int, isa: int) -> dict:
    ext = ops.native()
    gen = torch.Generator().manual_seed(n)
    spans = -(-n // SPAN)
    k_cache = torch.randn(spans, SPAN, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(spans, SPAN, KVH, D, generator=gen).to(dtype)
    slots = (torch.randperm(spans, generator=gen)[:, None] * SPAN + torch.arange(SPAN)).reshape(-1)[:n]
    q = torch.randn(n, H, D, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def native():
        ext.prefill_attention(q, k_cache, v_cache, slots, out, D ** -0.5, isa)

    def sdpa():
        k = k_cache.view(-1, KVH, D)[slots].transpose(0, 1)[None]
        v = v_cache.view(-1, KVH, D)[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    def repeated(fn):
        return lambda: [fn() for _ in range(reps)]

    totals = interleaved_times({"native": repeated(native), "sdpa": repeated(sdpa)}, rounds)
    times = {name: [t / reps for t in ts] for name, ts in totals.items()}
    flops = 4 * H * D * n * n / 2
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"native_ms": ms["native"], "sdpa_ms": ms["sdpa"],
            "sdpa_over_native": statistics.median(s / t for s, t in zip(times["sdpa"], times["native"])),
            "native_gflops": flops / (ms["native"] / 1e3) / 1e9, "sdpa_gflops": flops / (ms["sdpa"] / 1e3) / 1e9}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--as-avx2", action="store_true", help="the AVX2 code, ATen capped at AVX2 (docstring)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    common.check_as_avx2(args.as_avx2)
    if ops.native() is None or ops.isa_level() < ops.ISA_AVX2:
        raise SystemExit("the native prefill attention needs the native extension and an AVX2 or AVX-512 CPU")
    isa = ops.isa_level()   # ISA level 1 under --as-avx2 (ALLSPARK_CPU_ISA)
    torch.set_num_threads(args.threads)
    results = {}
    for dtype in args.dtypes:
        for n in args.lengths:
            row = case(n, getattr(torch, dtype), args.reps, args.rounds, isa)
            results[f"{dtype} {n}"] = row
            print(f"{dtype} {n:5d} rows: native {row['native_ms']:.2f} ms ({row['native_gflops']:.0f} GFLOP/s), "
                  f"SDPA {row['sdpa_ms']:.2f} ms ({row['sdpa_gflops']:.0f}): {row['sdpa_over_native']:.2f}x",
                  flush=True)
    report = {"machine": common.machine_name(), "machine_kind": common.cpu_kind(), "threads": args.threads, "isa": isa,
              "aten_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
              "heads": [H, KVH, D], "rounds": args.rounds, "reps": args.reps, "results": results}
    measure = "prefill-attention-as-avx2" if args.as_avx2 else "prefill-attention"
    common.write_report(args.json or common.result_path(measure), report)


if __name__ == "__main__":
    main()
