"""Batch-1 GEMV chains of the 0.5 B benchmark model (16 layers of qkv [2560, 1536], o [1536, 1536], gate_up
[8192, 1536], down [1536, 4096]): the bf16 dense GEMV against the quantized GEMV per format and ISA level.

Every layer has its own weights, so a chain streams them from memory as a decode step does. The variants run
interleaved, one chain each per round, and the report is each variant's median time and its ratio to the bf16
chain's time in the same round (median over rounds): on a shared machine only same-round ratios mean much.

With --bound, "read" rows add the streaming bound of each weight layout: the same bytes (codes, then each row's
scales and zero points) read in the same row order and thread split without any arithmetic (native
`stream_rows`). A kernel over those bytes has little to gain beyond it (the bf16 and int8 GEMVs run at it, within
a few percent either way, on the AVX2 VM), so `bf16 / read <format>` is about the largest GEMV-chain speedup that
format can give over bf16 on this machine.

    PYTHONPATH=. python benchmarks/gemv_quant_micro.py [--rounds 15] [--threads 2] [--rows 1] [--a8] [--bound]
        [--formats uint4:32 uint4_min:32] [--shape 2048 2048 --layers 1] [--gemm]

--formats picks the quantized variants (format:group); --shape replaces the model's four weights by one of that
shape, repeated over --layers layers (1: the same weight every round, so it may stay in cache); --base FORMAT:GROUP
adds a column: each variant's time over that format's at the same ISA level and rounding of x, in the same round
(median over rounds), e.g. uint4_min against uint4. --gemm adds each format's many-row paths (the weight dequantized
for ATen's GEMM): with --rows above a few, where the native kernel stops paying (native/kernels.h: quant_native_rows).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from allspark_server.compute import ops
from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight, has_mins

SHAPES = ((2560, 1536), (1536, 1536), (8192, 1536), (1536, 4096))   # qkv, o, gate_up, down
LAYERS = 16
FORMATS = (("int8", -1), ("int4", 32), ("uint4", 64), ("int4", 64), ("int4", 128))


def format_arg(text: str) -> tuple[str, int]:
    """'uint4_min:32' -> ("uint4_min", 32)."""
    fmt, _, group = text.partition(":")
    if fmt not in FORMAT_IDS or not group.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected FORMAT:GROUP with FORMAT one of {list(FORMAT_IDS)}")
    return fmt, int(group)


def random_quantized(n: int, k: int, fmt: str, group: int, g: torch.Generator, act_bits: int = 16) -> QuantizedWeight:
    """Random codes and scales in the stored layout (the speed does not depend on the values)."""
    groups = 1 if group == -1 else k // group
    cols = k // 2 if "4" in fmt else k
    codes = torch.randint(0, 256, (n, cols), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 1e-2).half()
    zeros = torch.randint(0, 16 if fmt.endswith("4") else 256, (n, groups), generator=g,
                          dtype=torch.uint8) if fmt.startswith("u") else None
    if has_mins(fmt):   # uint4_min: fp16 mins in place of the zero points
        zeros = (torch.rand(n, groups, generator=g) * -0.1).half()
    return QuantizedWeight(codes.view(torch.int8) if fmt == "int8" else codes, scales, zeros, fmt, group, k,
                           act_bits=act_bits)


def side_bytes(w: QuantizedWeight) -> torch.Tensor:
    """A row's scales and zero points (or mins) as one byte tensor [N, bytes] (what the GEMV reads beside the
    codes)."""
    parts = [t.contiguous().view(torch.uint8) for t in (w.scales, w.zeros) if t is not None]
    return torch.cat(parts, dim=1).contiguous()


def interleaved_times(variants: dict, rounds: int) -> dict:
    """Each variant (a callable) once to warm up, then `rounds` rounds of one call each in turn: {name: seconds}."""
    times = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--isa", type=int, nargs="*", help="quantized ISA levels to compare (default: 1 and the CPU's)")
    p.add_argument("--a8", action="store_true", help="also activate_quant (x rounded to int8) for every format")
    p.add_argument("--bound", action="store_true", help="also read each layout's bytes without arithmetic")
    p.add_argument("--formats", type=format_arg, nargs="+", default=list(FORMATS), help="FORMAT:GROUP variants")
    p.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), help="one weight shape instead of the model's")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers in a chain (each its own weights)")
    p.add_argument("--base", type=format_arg, help="FORMAT:GROUP: also each variant's time over this format's")
    p.add_argument("--gemm", action="store_true", help="also each format dequantized for ATen's GEMM, as ops.linear "
                   "(bf16 GEMM where the CPU has bf16 dot products) and the decode stack (fp32, widened by tiles) "
                   "run more rows than the native kernel takes: the crossover for quant_native_rows")
    args = p.parse_args(argv)
    shapes = [tuple(args.shape)] if args.shape else SHAPES
    torch.set_num_threads(args.threads)
    ext, g = ops.native(), torch.Generator().manual_seed(0)
    levels = args.isa or sorted({ops.ISA_AVX2, ops.isa_level()})
    xs = {k: torch.randn(args.rows, k, generator=g).bfloat16() for k in {k for _, k in shapes}}

    dense = [[torch.randn(n, k, generator=g).bfloat16() * 0.02 for n, k in shapes] for _ in range(args.layers)]
    variants = {"bf16": lambda: [ext.linear_small_m(xs[w.shape[1]], w, None, ops.isa_level())
                                 for layer in dense for w in layer]}
    base_of = {}   # quantized variant -> the --base format's variant at its ISA level and rounding of x
    if args.bound:
        variants["read bf16"] = lambda: [ext.stream_rows(w, None, ops.isa_level()) for layer in dense for w in layer]
    for (fmt, group), act_bits in itertools.product(args.formats, (16, 8) if args.a8 else (16,)):
        stored = [[random_quantized(n, k, fmt, group, g, act_bits) for n, k in shapes] for _ in range(args.layers)]
        if args.bound and act_bits == 16:   # the bytes per row do not depend on how x is rounded
            sides = [[side_bytes(w) for w in layer] for layer in stored]
            variants[f"read {fmt} g{group}"] = (
                lambda stored=stored, sides=sides: [ext.stream_rows(w.qweight, side, ops.isa_level())
                                                    for layer, ls in zip(stored, sides) for w, side in zip(layer, ls)])
        weights = [[ops.native_weight(w) for w in layer] for layer in stored]
        if args.gemm:
            name = f"{fmt} g{group}{'+a8' if act_bits == 8 else ''}"
            variants[f"{name} deq+gemm"] = (
                lambda stored=stored: [ops.linear_dequantized(xs[w.in_features], w) for layer in stored for w in layer])
            variants[f"{name} widened"] = (
                lambda weights=weights, stored=stored: [ext.linear_widened(xs[s.in_features], w, None, ops.isa_level())
                                                        for lw, ls in zip(weights, stored) for w, s in zip(lw, ls)])
        for isa in levels:
            base_of[f"{fmt} g{group}{'+a8' if act_bits == 8 else ''} isa{isa}"] = (
                None if args.base is None
                else f"{args.base[0]} g{args.base[1]}{'+a8' if act_bits == 8 else ''} isa{isa}")
            variants[f"{fmt} g{group}{'+a8' if act_bits == 8 else ''} isa{isa}"] = (
                lambda weights=weights, isa=isa: [ext.linear_quant(xs[k], w, None, isa)
                                                  for layer in weights for w, (_, k) in zip(layer, shapes)])
    times = interleaved_times(variants, args.rounds)
    base = times["bf16"]
    head = f"{'variant':<24} {'ms':>7} {'x bf16':>7}" + (f" {'t / ' + args.base[0]:>16}" if args.base else "")
    print(f"{head}   (rows {args.rows}, threads {args.threads}, {args.rounds} rounds)")
    for name, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        line = f"{name:<24} {statistics.median(ts) * 1e3:7.3f} {ratio:7.2f}"
        if base_of.get(name) in times:
            line += f" {statistics.median(t / b for t, b in zip(ts, times[base_of[name]])):16.3f}"
        print(line)


if __name__ == "__main__":
    main()
