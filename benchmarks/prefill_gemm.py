"""Prompt rows against quantized weights: the native kernels (int8 x with vpdpbusd, 16-bit x with vpdpwssd, the AVX2
ones) against the weight dequantized for ATen's GEMM, per format and row count, with the int8 multiply-adds per
second each reaches and, on AVX-512 VNNI CPUs, their share of the machine's vpdpbusd peak (benchmarks/vnni_peak.py,
measured in the same run, one core, times the threads). A dense bf16 weight's GEMM (ATen's: oneDNN) runs beside them,
with its share of the vdpbf16ps peak on AVX-512 BF16 CPUs: how near the library's bf16 GEMM comes to the instruction
a kernel of our own would be built on.

The weights are the CPU benchmark model's (common.FULL: qkv [2560, 1536], o [1536, 1536], gate_up [8192, 1536], down
[1536, 4096]) over --layers layers, each its own weights. Variants run interleaved, one pass each per round; reported:
each one's median ms and its speed over the dequantized GEMM's in the same round (median of the rounds' ratios).

    PYTHONPATH=. python benchmarks/prefill_gemm.py [--rows 128 512 2048] [--formats int8:32 int4:32 uint4_min:32]
        [--act-bits 8] [--isa 3 1] [--layers 2] [--rounds 5] [--threads 2] [--as-avx2] [--json PATH]

--as-avx2 runs everything as on an AVX2-only CPU (common.AVX2_CAPS): ATen, oneDNN and MKL capped at AVX2, the native
kernels at ISA level 1 and ATen's GEMM in fp32 (no bf16 dot products). An indication for that kind of machine from a
newer one; its own cores' rates differ.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.as_avx2_if_asked()   # before torch loads

import torch  # noqa: E402
import vnni_peak  # noqa: E402
from gemv_quant_micro import SHAPES, format_arg, interleaved_times, random_quantized  # noqa: E402

from allspark_server.compute import ops  # noqa: E402


def peak_macs_per_core(iterations: int = 5_000_000) -> dict:
    """Multiply-adds per second of one core (vnni_peak's loops): 'int8' (vpdpbusd) on AVX-512 VNNI CPUs, 'bf16'
    (vdpbf16ps) on AVX-512 BF16 ones; {} without either."""
    if not vnni_peak.has_vnni():
        return {}
    with tempfile.TemporaryDirectory() as d:
        lib = vnni_peak.build(d)
        out = {"int8": vnni_peak.rate(lib, 0, iterations) * 64}
        if vnni_peak.has_flag("avx512_bf16"):
            out["bf16"] = vnni_peak.rate(lib, vnni_peak.BF16_OP, iterations) * 32
        return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--formats", type=format_arg, nargs="+",
                   default=[("int8", 32), ("int4", 32), ("uint4_min", 32)])
    p.add_argument("--act-bits", type=int, choices=(8, 16), default=8,
                   help="8: activate_quant (int8 x); 16: x in int16")
    p.add_argument("--isa", type=int, nargs="*", help="native ISA levels (default: the CPU's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--as-avx2", action="store_true", help="as on an AVX2-only CPU (the docstring says how)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    common.check_as_avx2(args.as_avx2)
    torch.set_num_threads(args.threads)
    ext, g = ops.native(), torch.Generator().manual_seed(0)
    levels = args.isa or [ops.isa_level()]
    peaks = {} if args.as_avx2 else peak_macs_per_core()
    peak = peaks.get("int8")
    macs_per_row = sum(n * k for n, k in SHAPES) * args.layers
    out = {"machine": common.machine_name(), "machine_kind": common.cpu_kind(), "as_avx2": args.as_avx2,
           "threads": args.threads,
           "act_bits": args.act_bits, "layers": args.layers, "peak_macs_per_core": peaks, "rows": {}}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}
        dense = [[torch.randn(n, k, generator=g).bfloat16() * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
        variants = {"bf16 dense gemm": lambda dense=dense: [torch.nn.functional.linear(xs[w.shape[1]], w)
                                                            for ly in dense for w in ly]}
        for fmt, group in args.formats:
            stored = [[random_quantized(n, k, fmt, group, g, args.act_bits) for n, k in SHAPES]
                      for _ in range(args.layers)]
            native = [[ops.native_weight(w) for w in layer] for layer in stored]
            name = f"{fmt} g{group}"
            variants[f"{name} dequantized"] = (
                lambda stored=stored: [ops.linear_dequantized(xs[w.in_features], w) for ly in stored for w in ly])
            for isa in levels:
                variants[f"{name} native isa{isa}"] = (
                    lambda native=native, stored=stored, isa=isa: [
                        ext.linear_quant(xs[s.in_features], w, None, isa)
                        for lw, ls in zip(native, stored) for w, s in zip(lw, ls)])
        times = interleaved_times(variants, args.rounds)
        print(f"rows {rows}, threads {args.threads}, act_bits {args.act_bits}, {args.rounds} rounds"
              + (f", vpdpbusd peak {peak * args.threads / 1e9:.0f} G multiply-adds/s" if peak else ""))
        out["rows"][rows] = {}
        for name, ts in times.items():
            base = times[name.rsplit(" ", 2)[0] + " dequantized"] if "native" in name else ts   # x itself
            ms = statistics.median(ts) * 1e3
            rate = macs_per_row * rows / statistics.median(ts)
            speed = statistics.median(b / t for b, t in zip(base, ts))
            top = peaks.get("bf16" if name.startswith("bf16") else "int8")
            share = rate / (top * args.threads) if top else None
            out["rows"][rows][name] = {"ms": ms, "macs_per_s": rate, "over_dequantized": speed, "of_peak": share}
            print(f"  {name:<28} {ms:9.2f} ms {rate / 1e9:7.1f} GMAC/s  x{speed:5.2f}"
                  + (f"  {share:6.1%} of the {'vdpbf16ps' if name.startswith('bf16') else 'vpdpbusd'} peak"
                     if share else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
