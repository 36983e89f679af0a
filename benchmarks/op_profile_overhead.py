"""What op profiling costs: batch-1 decode tokens/s with profiling off and on, and (with --old) of a checkout
without the profiling code at all, each in its own resident Engine process, taking turns.

    python benchmarks/op_profile_overhead.py --old /path/to/checkout/without/profiling --turns 15
    python benchmarks/op_profile_overhead.py --quick --turns 5          # off against on only
    python benchmarks/op_profile_overhead.py --table                    # the op table, and how much it covers

The engines are ab_trees.py's workers (the benchmark model in bf16, a 32-token prompt, `--tokens` timed tokens);
"on" is this checkout's worker started with AS_PROFILE=ON, so the same engine code path decides it as a user's
environment would. Each turn runs every arm once, the order rotating; the medians of the per-turn ratios
off/old (the cost of the switch when off: the issue asks for less than 1%) and on/off are printed, and written
with every number to --out (JSON). Needs a quiet machine: a neighbour's load drifts faster than a turn.
--table instead decodes in this process with profiling on and prints the op table and the share of the step time
the ops cover (the issue asks for at least 90%).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ab_trees import Tree  # noqa: E402
from common import add_smoke_flag, build_model, spec_of  # noqa: E402


def start(tree: str, src: str, tokens: int, profiling: bool) -> Tree:
    """The tree's worker, with AS_PROFILE=ON in its environment when `profiling` (OFF otherwise)."""
    saved = {k: os.environ.get(k) for k in ("AS_PROFILE", "ALLSPARK_PROFILE")}
    os.environ.pop("ALLSPARK_PROFILE", None)
    os.environ["AS_PROFILE"] = "ON" if profiling else "OFF"
    try:
        return Tree(tree, src, "bf16", tokens, "cpu")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def table(src: str, tokens: int) -> dict:
    """The op table of a batch-1 decode of `tokens` tokens after a 32-token prompt, and the ops' share of the steps."""
    from allspark_server import Engine, HuggingFaceModel
    loader = HuggingFaceModel(src, "prof", user_set_data_type="bfloat16")
    out = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "op_profile", os.path.basename(src))
    loader.load_model().serialize(None, model_output_dir=out).free_model()
    engine = Engine()
    try:
        engine.install_model(loader.create_reference_runtime_config_builder("prof", "cpu", [0], max_batch=1)
                             .max_length(64 + tokens).kv_cache_span_size(32).profiling().build())
        engine.start_model("prof")
        gen = {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []}
        status, handle, queue = engine.start_request("prof", {"input_ids": list(range(3, 35))}, gen)
        engine.sync_request("prof", handle)
        engine.release_request("prof", handle)
        report = engine.get_op_profile("prof")
    finally:
        engine.shutdown()
    print(report.table())
    step = report.steps[0]
    covered = 1 - report.untimed_ms(0) / step.step_ms
    print(f"the ops cover {100 * covered:.2f}% of {step.steps} steps ({step.step_ms:.1f} ms)")
    return {"covered": covered, "steps": step.steps, "step_ms": step.step_ms,
            "ops": {o.op: [o.count, o.sum_ms] for o in report.ops}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", help="a checkout without op profiling (native extension built in place)")
    p.add_argument("--turns", type=int, default=15, help="timed decodes per arm")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="the small model")
    add_smoke_flag(p)
    p.add_argument("--table", action="store_true", help="print the op table of one decode instead of timing arms")
    p.add_argument("--out", help="write every turn's numbers here (JSON)")
    args = p.parse_args(argv)

    src = build_model(spec_of(args), "bfloat16")
    if args.table:
        result = table(src, args.tokens)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    here = os.path.dirname(HERE)
    arms = {"off": (here, False), "on": (here, True)}
    if args.old:
        arms = {"old": (args.old, False), **arms}
    workers = {name: start(tree, src, args.tokens, on) for name, (tree, on) in arms.items()}
    rates = {name: [] for name in arms}
    order = list(arms)
    try:
        for turn in range(args.turns + 1):
            for name in order[turn % len(order):] + order[:turn % len(order)]:
                rate = workers[name].decode()
                if turn:                                          # turn 0 warms every arm up
                    rates[name].append(rate)
            if turn:
                print(f"turn {turn}: " + "  ".join(f"{n} {rates[n][-1]:.2f}" for n in order) + " tokens/s", flush=True)
    finally:
        for w in workers.values():
            w.close()
    pairs = [("off", "old"), ("on", "off")] if args.old else [("on", "off")]
    summary = {f"{a}/{b}": statistics.median(x / y for x, y in zip(rates[a], rates[b])) for a, b in pairs}
    for key, ratio in summary.items():
        print(f"{key}: {ratio:.4f} (median of {args.turns} per-turn ratios)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens_per_s": rates, "median_ratio": summary, "tokens": args.tokens, "quick": args.quick,
                       "time": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
