"""What op profiling costs: batch-1 decode tokens/s with profiling off and on, and (with --old) of a checkout
without the profiling code at all, each in its own resident Engine process, taking turns.

    python benchmarks/op_profile_overhead.py --old /path/to/checkout/without/profiling --turns 15
    python benchmarks/op_profile_overhead.py --quick --turns 5          # off against on only

The engines are ab_trees.py's workers (the benchmark model in bf16, a 32-token prompt, `--tokens` timed tokens);
"on" is this checkout's worker started with AS_PROFILE=ON, so the same engine code path decides it as a user's
environment would. Each turn runs every arm once, the order rotating; the medians of the per-turn ratios
off/old (the cost of the switch when off: the issue asks for less than 1%) and on/off are printed, and written
with every number to --out (JSON). Needs a quiet machine: a neighbour's load drifts faster than a turn.
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
from common import FULL, QUICK, build_model  # noqa: E402


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", help="a checkout without op profiling (native extension built in place)")
    p.add_argument("--turns", type=int, default=15, help="timed decodes per arm")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="the small model (a smoke run)")
    p.add_argument("--out", help="write every turn's numbers here (JSON)")
    args = p.parse_args(argv)

    src = build_model(QUICK if args.quick else FULL, "bfloat16")
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
