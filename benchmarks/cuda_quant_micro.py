"""Micro-benchmark of the GPU quantized matmul (allspark_server/cuda/quant_kernels.py) on Llama-2-7B's linear
shapes: each weight format against cuBLAS on the bf16 weight and against dequantize + cuBLAS, for decode and
prefill row counts, each call timed as CUDA-graph replays (no launch overhead; the rows on one copy of the weight,
so the smaller ones partly from L2). --sweep also times launch configs for the decode row over weight copies
past L2 (what choose_config's table comes from), --sweep-only that alone for every shape. Writes JSON; run on a
GPU machine:

    python benchmarks/cuda_quant_micro.py [--sweep | --sweep-only] [--formats FMT:GROUP ...] [--rows M ...]
                                          [--out PATH]

--smoke: one small shape, two row counts, one copy of each weight, two configs a sweep; without a GPU the
kernels run in Triton's interpreter on CPU tensors (it checks that the script runs; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import itertools

import common
import torch
import torch.nn.functional as F
import triton
from cuda_common import copies_past_l2, device, per_call_us, time_us  # first: Triton's interpreter without a GPU

from allspark_server.compute.cuda import quant_kernels as qk
from allspark_server.quant.formats import QuantizedWeight, quantize

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
VARIANTS = [("int8", -1), ("int4", 128), ("uint4", 64), ("int4", 32)]
ROWS = [1, 8, 16, 32, 64, 128, 512, 2048]
SWEPT = [("int8", -1), ("int4", 128)]     # the formats whose decode configs --sweep times
SMOKE_SHAPES = {"o": (16, 128)}          # a few programs: the interpreter is slow
SMOKE_ROWS = [1, 128]                     # the GEMV and the tensor-core tiles
SMOKE = False                 # --smoke: one copy of each weight, two configs a sweep


def quant_copies(w: QuantizedWeight) -> list[QuantizedWeight]:
    """w and clones of its tensors, copies_past_l2 of them."""
    copies = 1 if SMOKE else copies_past_l2(weight_bytes(w))
    return [w] + [QuantizedWeight(w.qweight.clone(), w.scales.clone(), None if w.zeros is None else w.zeros.clone(),
                                  w.fmt, w.group_size, w.in_features) for _ in range(copies - 1)]


def weight_bytes(w: QuantizedWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None)


def sweep(w: QuantizedWeight, m: int, n: int, k: int) -> dict:
    """Time launch configs at m rows: the FMA GEMV's grid (m <= GEMV_MAX_ROWS) or the tensor-core tiles'."""
    x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
    ws = quant_copies(w)
    if m <= qk.GEMV_MAX_ROWS:
        grid = itertools.product((2, 4, 8), (1024, 2048, 4096), (1,), (4, 8), (1,), ("", "evict_first"))
    else:
        grid = itertools.product((32, 64), (64, 128, 256), (1, 2, 4), (4, 8), (3, 4), ("",))
    best, errors = [], []
    for bn, bk, split, warps, stages, eviction in list(grid)[:2] if SMOKE else grid:
        if w.group_size != -1 and bk > w.group_size and m > qk.GEMV_MAX_ROWS:
            continue
        cfg = qk.LaunchConfig(triton.next_power_of_2(m) if m <= qk.GEMV_MAX_ROWS else min(64, max(16, m)), bn, bk,
                              split, warps, stages, eviction)
        try:
            qk.quant_matmul(x, w, config=cfg)       # compile outside the graph capture
            us = per_call_us(lambda wi: qk.quant_matmul(x, wi, config=cfg), ws)
        except Exception as e:   # out of shared memory and the like
            errors.append(f"{[bn, bk, split, warps, stages, eviction]}: {type(e).__name__}: {str(e)[:200]}")
            continue
        best.append((us, [bn, bk, split, warps, stages, eviction]))
    best.sort()
    if not best:
        return {"errors": errors[:3]}
    chosen = qk.choose_config(m, n, k, w.group_size, x.device, w.fmt)
    return {"best": best[:5], "chosen": [chosen.block_n, chosen.block_k, chosen.split_k, chosen.num_warps,
                                         chosen.num_stages],
            "chosen_us": per_call_us(lambda wi: qk.quant_matmul(x, wi), ws),
            "gbs_best": weight_bytes(w) / best[0][0] / 1e3,
            "errors": errors[:3]}


def group_size_of(key: str) -> int:
    return int(key.rsplit("_g", 1)[1])


def main(argv=None) -> None:
    global SMOKE
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-only", action="store_true", help="only the decode row's config sweep, every shape")
    p.add_argument("--smoke", action="store_true", help="small shapes, two configs a sweep (see the docstring)")
    p.add_argument("--formats", nargs="+", default=None, metavar="FMT:GROUP",
                   help="the formats timed and swept (default: VARIANTS timed, SWEPT swept)")
    p.add_argument("--rows", nargs="+", type=int, default=None, help=f"row counts (default {ROWS})")
    p.add_argument("--out", default=None, help="default: benchmarks/results/cuda-quant-micro-<machine>.json "
                   "(--sweep-only: cuda-quant-sweep-<machine>.json; --smoke: under results/quick/)")
    a = p.parse_args(argv)
    if device() != "cuda" and not a.smoke:
        raise SystemExit("cuda_quant_micro.py needs a GPU (--smoke runs without one)")
    SMOKE = a.smoke
    variants, swept, rows = VARIANTS, SWEPT, a.rows or (SMOKE_ROWS if a.smoke else ROWS)
    if a.formats:
        variants = swept = [(f, int(g)) for f, _, g in (text.partition(":") for text in a.formats)]
    a.out = a.out or common.result_path("cuda-quant-sweep" if a.sweep_only else "cuda-quant-micro", device(), a.smoke)
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if device() == "cuda" else "cpu (Triton's interpreter)",
              "rows": {}, "sweep": {}}
    for name, (n, k) in (SMOKE_SHAPES if a.smoke else SHAPES).items():
        w16 = (torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16)
        quants = {}
        for fmt, group in swept if a.sweep_only else variants:
            q = {key: t.to(device()) for key, t in quantize(w16.float().cpu(), fmt, group).items()}
            quants[f"{fmt}_g{group}"] = QuantizedWeight(q["qweight"], q["scales"], q.get("zeros"), fmt, group, k)
        for m in () if a.sweep_only else rows:
            x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
            row = {"bf16_cublas_us": time_us(lambda: F.linear(x, w16))}
            row["bf16_gbs"] = n * k * 2 / row["bf16_cublas_us"] / 1e3
            for key, w in quants.items():
                us = time_us(lambda: qk.quant_matmul(x, w))
                row[f"{key}_us"] = us
                row[f"{key}_gbs"] = weight_bytes(w) / us / 1e3
                row[f"{key}_vs_bf16"] = row["bf16_cublas_us"] / us
                if m >= 128:
                    row[f"{key}_dequant_cublas_us"] = time_us(lambda: F.linear(x, w.dequantize().to(x.dtype)))
                if group_size_of(key) == -1 and m <= 16:
                    ref = F.linear(x.float(), w.dequantize())
                    got = qk.quant_matmul(x, w).float()
                    row[f"{key.split('_g')[0]}_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
            report["rows"][f"{name}_m{m}"] = row
            print(name, m, {k2: round(v, 2) for k2, v in row.items()}, flush=True)
        if a.sweep_only or (a.sweep and name in ("o", "gate_up")):
            for key in (f"{fmt}_g{group}" for fmt, group in swept):
                for m in (1,):
                    report["sweep"][f"{name}_{key}_m{m}"] = sweep(quants[key], m, n, k)
                    print("sweep", name, key, m, report["sweep"][f"{name}_{key}_m{m}"], flush=True)
        common.write_report(a.out, report)


if __name__ == "__main__":
    main()
