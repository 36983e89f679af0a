"""TTFT of an activate_quant int8 per-channel model (int8 + a8 + head) with and without the int8 GEMM, against the
same weights in bf16, interleaved in one run.

allspark_server/compute/ops.py sends the prefill rows of such weights (up to INT8_GEMM_MAX_ROWS) to an int8 GEMM
(linear_int8_gemm) on CPUs with AMX int8, instead of dequantizing each weight into bf16 for oneDNN's bf16 GEMM. This
measures both paths on the benchmark model of run.py, one Engine serving both models, `ops.INT8_GEMM` switched
between the calls. Each round gives each of the three runs a fresh prompt of the same length (its own series: the
quantized model runs twice a round, and a prompt it has seen would hit the prefix cache), starting with a different
one each round; ratios are medians of same-round ratios.

    python benchmarks/int8_gemm.py [--prompts 128 512 1024] [--repeats 11] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common
import workloads as W

RUNS = {"bf16": None, "int8_gemm": True, "dequantized": False}    # the value of ops.INT8_GEMM for each run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", default=None, help="default: benchmarks/results/int8-gemm-<machine>.json "
                   "(--smoke: under results/quick/)")
    common.add_smoke_flag(p)
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("int8-gemm", quick=a.smoke)
    from allspark_server import Engine, HuggingFaceModel
    from allspark_server.compute import ops
    torch.set_num_threads(a.threads)
    spec = common.spec_of(a)
    hf_dir = common.build_model(spec, "bfloat16")
    dense = HuggingFaceModel(hf_dir, "bench-bfloat16", user_set_data_type="bfloat16")
    dense.load_model().serialize_to_path(None, hf_dir, skip_if_exists=False).free_model()
    quant = HuggingFaceModel(hf_dir, "bench-int8-a8-head", user_set_data_type="bfloat16")
    quant.load_model().serialize_to_path(None, os.path.join(hf_dir, "quant"), enable_quant=True,
                                         customized_quant_config=common.quant_variant("int8+a8+head")).free_model()
    engine = Engine()
    for loader in (dense, quant):
        engine.install_model(common.runtime_cfg(loader, loader.model_name, spec, 8))
        engine.start_model(loader.model_name)

    def first_token_s(run: str, ids: list[int]) -> float:
        ops.INT8_GEMM = RUNS[run]
        return W.first_token_s(engine, dense.model_name if run == "bf16" else quant.model_name, ids)

    report = {"machine": common.machine_name(), "threads": a.threads, "cpu_has_amx_int8": "amx_int8" in ops.cpu_flags(),
              "repeats": a.repeats, "ttft": {}}
    try:
        order = list(RUNS)
        for n in a.prompts:
            for i, run in enumerate(order):                                  # warm-up
                first_token_s(run, W.ttft_prompt(n, 10_000, spec["vocab"], salt=10 + i))
            ts = {run: [] for run in order}
            for r in range(a.repeats):
                for run in order[r % len(order):] + order[:r % len(order)]:
                    ts[run].append(first_token_s(run, W.ttft_prompt(n, r, spec["vocab"], salt=1 + order.index(run))))

            def ratio(x: str, y: str) -> float:
                return statistics.median(u / v for u, v in zip(ts[x], ts[y]))
            row = {f"{run}_s": statistics.median(t) for run, t in ts.items()}
            row.update(int8_gemm_vs_bf16=ratio("int8_gemm", "bf16"), dequantized_vs_bf16=ratio("dequantized", "bf16"),
                       int8_gemm_vs_dequantized=ratio("int8_gemm", "dequantized"))
            report["ttft"][str(n)] = row
            print(f"TTFT {n} tokens: bf16 {row['bf16_s'] * 1e3:.0f} ms; int8 + a8 + head with the int8 GEMM "
                  f"{row['int8_gemm_vs_bf16']:.3f}x bf16, dequantized {row['dequantized_vs_bf16']:.3f}x "
                  f"(int8 GEMM / dequantized {row['int8_gemm_vs_dequantized']:.3f})", flush=True)
    finally:
        ops.INT8_GEMM = None
        engine.shutdown()
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
