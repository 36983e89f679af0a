"""Micro-benchmark of the Triton decode GEMV (allspark_server/cuda/gemv_kernels.py) against cuBLAS (F.linear) on
Llama-2-7B's bf16 linear shapes, whole and as a 2-rank pool's shards, at 1, 2 and 4 rows: weight bytes read per
second, each call timed as CUDA-graph replays over enough copies of the weight that none of them stays in L2
(a decode step reads every weight once). Also the MLP's gate_up + silu·mul: cuBLAS then fused_kernels.silu_mul,
against the GEMV with the silu·mul epilogue. --sweep times launch configs at one row (what choose_config's
table comes from). Writes JSON; run on a GPU machine:

    python benchmarks/cuda_gemv_micro.py [--sweep] [--out PATH]
    python benchmarks/cuda_gemv_micro.py --shapes smollm2 --sweep     # SmolLM2's shapes over small-K tiles
    python benchmarks/cuda_gemv_micro.py --lora-sweep    # tiles alone and carrying a LoRA shrink (+ its expand)

--smoke: two small shapes, one copy of each weight, two configs of a sweep; without a GPU the kernels run in
Triton's interpreter on CPU tensors (it checks that the script runs; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import common
import torch
import torch.nn.functional as F
import triton
from cuda_common import copies_past_l2, device, per_call_us  # first: it sets Triton's interpreter without a GPU

from allspark_server.compute.cuda import fused_kernels as fk
from allspark_server.compute.cuda import gemv_kernels as gk

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096), "qkv_tp2": (6144, 4096), "o_tp2": (4096, 2048), "gate_up_tp2": (11008, 4096),
          "down_tp2": (4096, 5504)}
ROWS = (1, 2, 4)
SWEEP = list(itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8), (1, 3)))
SILU_SWEEP = list(itertools.product((1, 2, 4), (2048, 4096), (4, 8), (1,)))    # the fused gate_up + silu·mul
# --shapes smollm2: SmolLM2-135M's bf16 shapes (K = 576 or 1536), and the sweep grid for such small K
SMOLLM2_SHAPES = {"qkv_smollm2": (960, 576), "o_smollm2": (576, 576), "gate_up_smollm2": (3072, 576),
                  "down_smollm2": (576, 1536), "lm_head_smollm2": (49152, 576)}
SMALL_K_SWEEP = list(itertools.product((2, 4, 8, 16), (512, 1024), (4, 8), (1,)))
SMOKE_SHAPES = {"qkv": (8, 64), "gate_up_tp2": (8, 64)}         # a few programs each: the interpreter is slow
SMOKE_ROWS = (1, 2)


def weight_copies(n: int, k: int, smoke: bool = False) -> list[torch.Tensor]:
    copies = 1 if smoke else copies_past_l2(n * k * 2)
    return [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16) for _ in range(copies)]


def shape_rows(ws: list[torch.Tensor], name: str, row_counts=ROWS) -> dict:
    n, k = ws[0].shape
    rows = {}
    for m in row_counts:
        x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
        row = {"cublas_us": per_call_us(lambda w: F.linear(x, w), ws)}
        ref = F.linear(x.float(), ws[0].float())
        row["triton_rel_err"] = ((gk.gemv(x, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
        row["triton_us"] = per_call_us(lambda w: gk.gemv(x, w), ws)     # past GEMV_MAX_ROWS too: where to stop
        normal = dataclasses.replace(gk.choose_config(k, n), eviction="")
        row["triton_normal_policy_us"] = per_call_us(lambda w: gk.gemv(x, w, config=normal), ws)
        for key in ("cublas", "triton"):
            row[f"{key}_gbs"] = n * k * 2 / row[f"{key}_us"] / 1e3
        row["triton_vs_cublas"] = row["cublas_us"] / row["triton_us"]
        if name.startswith("gate_up"):
            row["cublas_silu_mul_us"] = per_call_us(lambda w: fk.silu_mul(F.linear(x, w)), ws)
            row["triton_silu_mul_us"] = per_call_us(lambda w: fk.silu_mul(gk.gemv(x, w)), ws)
            row["fused_silu_mul_us"] = per_call_us(lambda w: gk.gemv_silu_mul(x, w), ws)
            row["fused_vs_cublas_silu_mul"] = row["cublas_silu_mul_us"] / row["fused_silu_mul_us"]
            row["fused_vs_triton_silu_mul"] = row["triton_silu_mul_us"] / row["fused_silu_mul_us"]
        rows[f"m{m}"] = row
    return rows


def sweep(ws: list[torch.Tensor], kernel=gk.gemv, grid=SWEEP) -> dict:
    """kernel(x, w, config=...) at one row over `grid`'s configs (block_n, block_k, warps, stages)."""
    n, k = ws[0].shape
    x = torch.randn(1, k, device=device(), dtype=torch.bfloat16)
    timed, errors = [], []
    for bn, bk, warps, stages in grid:
        cfg = gk.GemvConfig(bn, bk, warps, stages)
        try:
            kernel(x, ws[0], config=cfg)       # compile outside the graph capture
            us = per_call_us(lambda w: kernel(x, w, config=cfg), ws)
        except Exception as e:   # out of registers / shared memory and the like
            errors.append(f"{[bn, bk, warps, stages]}: {type(e).__name__}: {str(e)[:160]}")
            continue
        timed.append((round(us, 2), round(n * k * 2 / us / 1e3, 1), [bn, bk, warps, stages]))
    timed.sort()
    chosen = gk.choose_config(k, n, kernel is gk.gemv_silu_mul)
    return {"best": timed[:6], "worst": timed[-2:], "errors": errors[:3],
            "chosen": [chosen.block_n, chosen.block_k, chosen.num_warps, chosen.num_stages]}


# --lora-sweep: the 7B model of the LoRA benchmark (Llama-2-7B's shapes with 8 KV heads, as speculative.SEVEN_B),
# each projection's rank with a rank-16 adapter on every module (q|k|v 48, gate|up 32; the LM head none); the tiles
# that can carry a shrink (8 warps), k-tiles 1024 to 4096
LORA_SHAPES = {"qkv_gqa": (6144, 4096, 48), "o": (4096, 4096, 16), "gate_up": (22016, 4096, 32),
               "down": (4096, 11008, 16), "lm_head": (32000, 4096, 0), "qkv_gqa_tp2": (3072, 4096, 48),
               "o_tp2": (4096, 2048, 16), "gate_up_tp2": (11008, 4096, 32), "down_tp2": (4096, 5504, 16)}
LORA_SWEEP = list(itertools.product((2, 4, 8), (1024, 2048, 4096), (8,), (1,)))
SMOKE_LORA_SHAPES = {"o": (16, 64, 4), "gate_up": (32, 64, 8)}
SMOKE_LORA_SWEEP = [(2, 32, 8, 1), (4, 64, 8, 1)]


def lora_sweep(ws: list[torch.Tensor], rank: int, grid=LORA_SWEEP, gate_up: bool = False) -> dict:
    """At one row, each tile of `grid`: the plain GEMV, and (rank > 0) the launch carrying a rank-`rank` adapter's
    shrink followed by its expand (lora_kernels.Shrink: what a LoRA row's projection costs), and for a gate_up
    weight (gate_up) the fused silu·mul launch over its halves. Each tile's microseconds, sorted by the adapter's
    time."""
    from allspark_server.compute.cuda import lora_kernels as lk
    n, k = ws[0].shape
    x = torch.randn(1, k, device=device(), dtype=torch.bfloat16)
    plan = None
    if rank:
        a = (torch.randn(2, rank, k, device=device()) * 0.02).to(torch.bfloat16)
        b = (torch.randn(2, n, rank, device=device()) * 0.02).to(torch.bfloat16)
        plan = lk.Shrink.of(x, a, b, torch.zeros(1, dtype=torch.int64, device=device()))
    timed = []
    for bn, bk, warps, stages in grid:
        if bk > triton.next_power_of_2(k):
            continue
        cfg = gk.GemvConfig(bn, bk, warps, stages)
        row = {"tile": [bn, bk, warps, stages],
               "plain_us": round(per_call_us(lambda w: gk.gemv(x, w, config=cfg), ws), 2)}
        if plan is not None:
            row["lora_us"] = round(per_call_us(lambda w: gk.gemv(x, w, config=cfg, lora=plan), ws), 2)
        if gate_up:
            row["silu_mul_us"] = round(per_call_us(lambda w: gk.gemv_silu_mul(x, w, config=cfg), ws), 2)
        timed.append(row)
    timed.sort(key=lambda r: r.get("lora_us", r["plain_us"]))
    chosen = gk.choose_config(k, n)
    return {"rank": rank, "tiles": timed, "chosen": [chosen.block_n, chosen.block_k, chosen.num_warps,
                                                     chosen.num_stages]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--silu-sweep", action="store_true", help="sweep the fused gate_up + silu·mul's configs only")
    p.add_argument("--lora-sweep", action="store_true",
                   help="only LORA_SHAPES' tiles, plain and carrying a LoRA adapter's shrink + expand (lora_sweep)")
    p.add_argument("--smoke", action="store_true", help="small shapes, two configs a sweep (see the docstring)")
    p.add_argument("--shapes", choices=["7b", "smollm2"], default="7b",
                   help="smollm2: SmolLM2's shapes, the LM head swept too, over SMALL_K_SWEEP")
    p.add_argument("--out", default=None, help="default: benchmarks/results/cuda-gemv-micro-<machine>.json "
                   "(--lora-sweep: cuda-gemv-lora-<machine>.json) "
                   "(--smoke: under results/quick/)")
    a = p.parse_args(argv)
    if device() != "cuda" and not a.smoke:
        raise SystemExit("cuda_gemv_micro.py needs a GPU (--smoke runs without one)")
    measure = "cuda-gemv-lora" if a.lora_sweep else "cuda-gemv-micro" + ("-smollm2" if a.shapes == "smollm2" else "")
    a.out = a.out or common.result_path(measure, device(), a.smoke)
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if device() == "cuda" else "cpu (Triton's interpreter)",
              "rows": {}, "sweep": {}}
    small = a.shapes == "smollm2"
    if a.lora_sweep:
        report["lora_sweep"] = {}
        for name, (n, k, rank) in (SMOKE_LORA_SHAPES if a.smoke else LORA_SHAPES).items():
            ws = weight_copies(n, k, a.smoke)
            report["lora_sweep"][name] = lora_sweep(ws, rank, SMOKE_LORA_SWEEP if a.smoke else LORA_SWEEP,
                                                    name.startswith("gate_up"))
            print("lora sweep", name, json.dumps(report["lora_sweep"][name]), flush=True)
            del ws
            if device() == "cuda":
                torch.cuda.empty_cache()
            common.write_report(a.out, report)
        return
    grids = (SWEEP[:2], SILU_SWEEP[:2]) if a.smoke else (SMALL_K_SWEEP, SMALL_K_SWEEP) if small else (SWEEP, SILU_SWEEP)
    for name, (n, k) in (SMOKE_SHAPES if a.smoke else SMOLLM2_SHAPES if small else SHAPES).items():
        ws = weight_copies(n, k, a.smoke)
        report["rows"][name] = shape_rows(ws, name, SMOKE_ROWS if a.smoke else ROWS)
        print(name, json.dumps(report["rows"][name]), flush=True)
        if a.sweep and (small or not name.startswith("lm_head")):
            report["sweep"][name] = sweep(ws, grid=grids[0])
            print("sweep", name, report["sweep"][name], flush=True)
        if (a.sweep or a.silu_sweep) and name.startswith("gate_up"):
            report["sweep"][f"{name}_silu_mul"] = sweep(ws, gk.gemv_silu_mul, grids[1])
            print("sweep", name, "silu_mul", report["sweep"][f"{name}_silu_mul"], flush=True)
        del ws
        if device() == "cuda":
            torch.cuda.empty_cache()
        common.write_report(a.out, report)


if __name__ == "__main__":
    main()
