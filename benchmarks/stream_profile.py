"""Where a step of many concurrent streams goes, on one of gguf_race.py's files: the op profile (AS_PROFILE=ON) of our
side serving `--streams` streams at once, per decode step, with each projection's multiply-adds per second and their
share of the CPU's multiply-add peak (benchmarks/vnni_peak.py: vpdpbusd for x as int8, vpdpwssd for x as int16).

    python benchmarks/stream_profile.py [--file q4_0+head] [--ours gguf-a8] [--streams 32] [--json PATH]

The prompts (128 random tokens each) are prefilled first. Each op's total is divided by the decode steps (the
attention op's count over the layers; prefill attends through prefill_attention), and a decode step's time is the sum
of those ops. The projections, attention and kv_store run only in decode steps; ops that the few prefill steps run
too (norm, lm_head, inputs, sample, embedding) are slightly overstated.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ["AS_PROFILE"] = "ON"    # before the engine exists: every op of every step is timed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import gguf_race as GR
import torch

DECODE_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "attention", "kv_store", "norm",
              "act_mul", "rotary", "inputs", "sample", "embedding", "rope_rows", "final_norm", "apply_plan",
              "lm_head_gather")


def projection_weights(args: dict) -> dict:
    """Weights (multiply-adds per row of x) of each projection op, from the model's args."""
    hidden, inter, layers = args["hidden_size"], args["intermediate_size"], args["num_layers"]
    heads, kv_heads = args["num_heads"], args["num_kv_heads"]
    head_dim = args.get("head_dim") or hidden // heads
    return {"qkv_proj": layers * hidden * (heads + 2 * kv_heads) * head_dim,
            "o_proj": layers * heads * head_dim * hidden,
            "gate_up_proj": layers * hidden * 2 * inter, "down_proj": layers * inter * hidden,
            "lm_head": args["vocab_size"] * hidden}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default="q4_0+head", help="smollm2, q8_0+head or q4_0+head (gguf_race.py's files)")
    p.add_argument("--ours", choices=["gguf", "gguf-a8"], default="gguf-a8")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--peak-gmacs", type=float, default=None, help="the machine's multiply-add peak, all threads "
                   "(G/s; default: none, no share of it is shown); vnni_peak.py prints one core's")
    p.add_argument("--json", default=None)
    common.add_smoke_flag(p)
    a = p.parse_args(argv)
    from allspark_server.compute import ops
    if ops.native() is None:
        raise SystemExit("stream_profile.py reads the native decode stack's op timings: the native extension is not "
                         "built (pip install --no-build-isolation -e .)")
    torch.set_num_threads(a.threads)
    spec = GR.race_spec(a.ours, smoke=a.smoke)
    f = GR.race_file(a.file, spec, "gguf")
    from allspark_server import Engine
    engine = Engine()
    try:
        ours = GR.Ours(engine, f["ours"], "m", spec, None, a.streams + 8)
        rng = random.Random(0)
        vocab = min(8000, spec["vocab"])      # below every file's vocabulary
        prompts = [[rng.randrange(100, vocab) for _ in range(GR.CONC_PROMPT)] for _ in range(a.streams)]
        ours.streams(prompts, a.new_tokens)
        report = engine.get_op_profile("m")
        args = json.loads(engine.get_model_info("m"))["args"]
        ours.close()
    finally:
        engine.shutdown()
    ops = {o.op: o for o in report.ops if o.rank == 0}
    steps = ops["attention"].count // args["num_layers"]       # decode steps (attention runs once a layer a step)
    weights = projection_weights(args)
    rows = {}
    for name in DECODE_OPS:
        if name in ops:
            ms = ops[name].sum_ms / steps
            row = {"ms_per_step": round(ms, 3)}
            if name in weights:     # rows of x per step: the streams (the LM head too: every stream samples)
                gmacs = weights[name] * a.streams / (ms * 1e-3) / 1e9
                row["gmac_per_s"] = round(gmacs, 1)
                if a.peak_gmacs:
                    row["share_of_peak"] = round(gmacs / a.peak_gmacs, 3)
            rows[name] = row
    step_ms = sum(r["ms_per_step"] for r in rows.values())
    out = {"machine": common.machine_name(), "machine_kind": common.machine_kind(), "file": a.file, "ours": a.ours,
           "streams": a.streams, "threads": a.threads, "decode_steps": steps, "decode_step_ms": round(step_ms, 2),
           "decode_tok_per_s": round(a.streams / (step_ms * 1e-3), 1),
           "projections_ms_per_step": round(sum(r["ms_per_step"] for n, r in rows.items() if n in weights), 2),
           "peak_gmacs": a.peak_gmacs, "ops": rows}
    print(json.dumps(out, indent=1))
    if a.json:
        common.write_report(a.json, out)


if __name__ == "__main__":
    main()
