"""What LoRA adds to a decode step's projections on a GPU, kernels alone: the four projections of every layer of a
Llama-2-7B-shaped bf16 model (q|k|v, o, gate|up with silu·mul, down; distinct weights per layer, 13 GB, so nothing
stays in L2) captured in one CUDA graph and replayed, with and without rank-16 adapters on all seven modules.

- "base": the GEMV (silu·mul in gate|up's epilogue) at one row, cuBLAS then silu·mul at 32;
- "lora": the same projections, then lora_kernels.lora_add_'s shrink and expand after each (and silu·mul after
  gate|up's): at 32 rows the rows use 8 adapters in turn;
- "in_gemv" (one row): the shrink's programs inside the GEMV's launch, then the expand: what cuda_ops runs there;
- "grouped" (32 rows): lora_grouped.py's shrink and expand (a program an adapter slot, on tensor cores) after the
  GEMM;
- "beside" (32 rows): the same kernels, the shrink on a side stream beside the GEMM (lora_kernels.
  grouped_lora_linear): what cuda_ops runs for q|k|v;
- "deferred" (32 rows): o, gate|up and down with the expand beside the GEMM too, into fp32 deltas that the
  residual add + RMSNorm after o and down, and silu·mul after gate|up, add as they read (pending_delta.py): what
  cuda_ops runs for them.

Every variant ends o and down with the residual add + RMSNorm that reads their output in a decode step.

Reports the median replay time of each (ms) and the ratios base / variant: the step's share that the projections
are; and, per variant, the GPU time of its kernels in one replay by kind (from the profiler), against the replay's
time: what the launches themselves cost, and what is gaps between them. Needs a CUDA device.

    python benchmarks/lora_kernels_micro.py [--layers 32] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from common import gpu_kind, result_path, write_report
from cuda_common import replay_median_ms

HIDDEN, INTER, RANK, ADAPTERS = 4096, 11008, 16, 8


def projections(layers: int, gen: torch.Generator):
    """Per layer: {name: (weight [N, K], A stack [S, R, K], B stack [S, N, R], act)} with R the parts' ranks."""
    def w(n, k):
        return (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    out = []
    for _ in range(layers):
        layer = {}
        for name, n, k, parts, act in (("qkv", 3 * HIDDEN, HIDDEN, 3, None), ("o", HIDDEN, HIDDEN, 1, None),
                                       ("gate_up", 2 * INTER, HIDDEN, 2, "silu"), ("down", HIDDEN, INTER, 1, None)):
            r = RANK * parts
            layer[name] = (w(n, k), w(ADAPTERS * r, k).view(ADAPTERS, r, k), w(ADAPTERS * n, r).view(ADAPTERS, n, r),
                           act)
        out.append(layer)
    return out


def step(variant: str, xs: dict, layers, slots, residual, norm_weight):
    from allspark_server.compute.cuda import fused_kernels as fused
    from allspark_server.compute.cuda import gemv_kernels as gk
    from allspark_server.compute.cuda import lora_kernels as lk
    from allspark_server.compute.pending_delta import output_and_delta
    for layer in layers:
        for name, (w, a, b, act) in layer.items():
            x = xs[name]
            if variant == "base" and act and x.shape[0] == 1:
                gk.gemv_silu_mul(x, w)
                continue
            delta = None
            if variant == "in_gemv":
                y = gk.gemv(x, w, lora=lk.Shrink.of(x, a, b, slots))
            elif variant in ("beside", "deferred"):
                y = lk.grouped_lora_linear(x, a, b, slots, lambda x=x, w=w: torch.nn.functional.linear(x, w),
                                           defer=variant == "deferred" and name != "qkv")
                y, delta = output_and_delta(y)
            else:
                y = gk.gemv(x, w) if x.shape[0] <= 2 else torch.nn.functional.linear(x, w)
            if variant == "grouped":
                lk.lora_add_(y, x, a, b, slots, grouped=True)
            if variant == "lora":
                lk.lora_add_(y, x, a, b, slots)
            if act:
                fused.silu_mul(y, delta=delta)
            elif name in ("o", "down"):     # the residual add + RMSNorm that reads o's and down's output
                fused.rms_norm(y, norm_weight, 1e-5, residual, delta=delta)


KINDS = ("shrink", "expand", "gemv", "silu", "norm", "gemm")     # a kernel's kind: the first of these in its name


def captured(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (compiled outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_ms(graph) -> dict:
    """GPU time of one replay's kernels by kind (ms; cuBLAS's under "gemm", the rest "other")."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.key_averages():
        if e.device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k in KINDS if k in name), "gemm" if "sm90" in name else "other")   # sm90_*: cuBLAS's
        out[kind] = out.get(kind, 0.0) + e.device_time_total / 1e3
    return {k: round(v, 4) for k, v in sorted(out.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None, help="default: benchmarks/results/lora-kernels-micro-<gpu>.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lora_kernels_micro.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = projections(args.layers, gen)
    report = {"measure": "lora-kernels-micro", "machine": torch.cuda.get_device_name(), "kind": gpu_kind(),
              "layers": args.layers, "rank": RANK, "adapters": ADAPTERS, "measured_at": time.strftime("%Y-%m-%d")}
    for rows in (1, 32):
        xs = {name: torch.randn(rows, INTER if name == "down" else HIDDEN, generator=gen, device="cuda").bfloat16()
              for name in ("qkv", "o", "gate_up", "down")}
        slots = (torch.arange(rows, device="cuda") % ADAPTERS)
        variants = ("base", "lora", "in_gemv") if rows == 1 else ("base", "lora", "grouped", "beside", "deferred")
        residual = torch.randn(rows, HIDDEN, generator=gen, device="cuda").bfloat16()
        norm_weight = torch.ones(HIDDEN, device="cuda").bfloat16()
        graphs = {v: captured(lambda v=v: step(v, xs, layers, slots, residual, norm_weight)) for v in variants}
        ms = {v: replay_median_ms(g, args.repeats) for v, g in graphs.items()}
        kernels = {v: kernel_ms(g) for v, g in graphs.items()}
        report[f"rows_{rows}"] = {"ms": ms, "base_over": {v: ms["base"] / t for v, t in ms.items()},
                                  "kernel_ms": kernels}
        print(f"rows {rows}: " + ", ".join(f"{v} {t:.3f} ms ({ms['base'] / t:.3f}x)" for v, t in ms.items()))
        for v, k in kernels.items():
            print(f"  {v} kernels: " + ", ".join(f"{kind} {t:.3f}" for kind, t in k.items())
                  + f" (sum {sum(k.values()):.3f} of {ms[v]:.3f} ms)")
    path = args.out or result_path("lora-kernels-micro", "cuda")
    write_report(path, report)
    print("wrote", path)


if __name__ == "__main__":
    main()
