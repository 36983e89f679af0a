"""A/B on one GPU: Python's thread switch interval under many concurrent in-process streams.

The Engine's thread gives the GIL away at every torch call (torch releases it there); with 128 consumer threads
woken every step, getting it back can take up to the switch interval (5 ms by default) each time. This runs the
concurrent rows of cuda_rows.py (128 in / 128 out, `--num` requests together, Llama-2-7B shape, bf16) with
each switch interval in turn, round by round, and reports decode-only tokens/s, the decode steps' GPU time and
the step profile's wall time and sampler launch per interval.

    PYTHONPATH=. python benchmarks/switch_interval_ab.py [--intervals-ms 5 0.5] [--num 128 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import cuda_common as CC  # noqa: E402
from cuda_rows import engine_concurrent  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 0.5])
    p.add_argument("--num", type=int, nargs="+", default=[128, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="default: benchmarks/results/switch-interval-<machine>.json")
    a = p.parse_args()
    a.json = a.json or common.result_path("switch-interval", "cuda")
    from allspark_server import Engine
    layers = CC.LLAMA2_7B["num_hidden_layers"]
    root = CC.bench_root(layers)
    CC.build_model(root, layers)
    loader = CC.serialized_bench_model(root)
    max_batch = max(a.num)
    cfg = (loader.create_reference_runtime_config_builder("bench-cuda", "cuda", [0], max_batch=max_batch)
           .max_length(CC.CONC_PROMPT + CC.CONC_NEW + 16).kv_cache_span_size(32)
           .kv_cache_memory(max_batch * (CC.CONC_PROMPT + CC.CONC_NEW + 32) * CC.kv_bytes_per_token(layers)).build())
    engine = Engine()
    engine.install_model(cfg)
    engine.start_model("bench-cuda")
    engine_concurrent(engine, 16)   # warm-up
    runs = {f"{iv}ms_c{n}": [] for iv in a.intervals_ms for n in a.num}
    for _ in range(a.rounds):
        for n in a.num:
            for iv in a.intervals_ms:
                sys.setswitchinterval(iv / 1e3)
                row = engine_concurrent(engine, n)
                ahead = row["steps"].get(f"decode b{n} ahead", {})
                runs[f"{iv}ms_c{n}"].append({"decode_tps": row["allspark_decode_tps"], "tps": row["allspark_tps"],
                                             "gpu_ms": row[f"graph_step_gpu_ms_b{n}"],
                                             "wall_ms": ahead.get("wall_ms"),
                                             "sampler_ms": ahead.get("sampler.start_rows_ms")})
                print(iv, n, runs[f"{iv}ms_c{n}"][-1], flush=True)
    sys.setswitchinterval(0.005)
    report = {"device": torch.cuda.get_device_name(), "runs": runs,
              "medians": {k: {f: statistics.median(r[f] for r in v if r[f] is not None) for f in v[0]}
                          for k, v in runs.items()}}
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["medians"], indent=1))
    engine.stop_model("bench-cuda")
    engine.release_model("bench-cuda")


if __name__ == "__main__":
    main()
