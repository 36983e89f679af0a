"""Same-run A/B of two source trees: batch-1 decode tokens/s of the CPU benchmark model, each tree in its own
process, rounds interleaved (A, B, A, B, ...) so that the machine's drift hits both alike.

    python benchmarks/ab_trees.py --old /path/to/old/checkout --new . --variants bf16 int8 int4_g32 --rounds 5
    python benchmarks/ab_trees.py --old /path/to/old/checkout --device cuda --variants bf16 --rounds 5

On a CPU each tree must have its native extension built in place; on a GPU (--device cuda) the model has
Llama-2-7B's shapes with --layers layers (16 by default: a bandwidth-bound batch-1 step of ~6.5 GB). A round of a tree serializes the model with that tree
(once per variant, cached under ~/.cache/allspark/ab), installs it in an Engine, decodes `--tokens` tokens after a
32-token prompt twice (the first run warms up) and reports the second run's decode rate: tokens after the first
over the time since the first arrived. Prints each variant's median new/old ratio; --out writes every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import FULL, QUICK, build_model, quant_variant, spin_openmp  # noqa: E402

WORKER = r"""
import json, os, sys, time
from allspark_server import Engine, HuggingFaceModel
src, variant, tokens, cache, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[6]
quant = json.loads(sys.argv[5])
name = "ab"
loader = HuggingFaceModel(src, name, user_set_data_type="bfloat16")
out = os.path.join(cache, variant)
if not os.path.exists(os.path.join(out, name + ".asparam")):
    loader.load_model()
    loader.serialize(None, model_output_dir=out, **({"enable_quant": True, "customized_quant_config": quant} if quant else {}))
    loader.free_model()
else:
    loader.graph_path, loader.weights_path = os.path.join(out, name + ".asgraph"), os.path.join(out, name + ".asparam")
engine = Engine()
cfg = (loader.create_reference_runtime_config_builder(name, device, [0], max_batch=1)
       .max_length(64 + tokens).kv_cache_span_size(32).build())
engine.install_model(cfg)
engine.start_model(name)
rates = []
for _ in range(2):
    gen = {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []}
    status, handle, queue = engine.start_request(name, {"input_ids": list(range(3, 35))}, gen)
    first, n = None, 0
    while n < tokens:
        el = queue.Get()
        if el is None:
            break
        if first is None:
            first = time.perf_counter()
            n_first = len(el.ids_from_generate)
        n += len(el.ids_from_generate)
    rates.append((n - n_first) / (time.perf_counter() - first))
    engine.release_request(name, handle)
engine.stop_model(name)
engine.release_model(name)
engine.shutdown()
print("AB_RESULT " + json.dumps({"tokens_per_s": rates[-1]}))
"""


def run_tree(tree: str, src: str, variant: str, tokens: int, device: str = "cpu") -> float:
    cache = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "ab", os.path.basename(os.path.abspath(tree))
                         + "-" + str(abs(hash(os.path.abspath(tree))) % 10 ** 6))
    quant = quant_variant(variant) if variant != "bf16" else {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree)] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, "-c", WORKER, src, variant, str(tokens), cache, json.dumps(quant), device],
                          cwd=os.path.abspath(tree), env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line[len("AB_RESULT "):])["tokens_per_s"]
    raise RuntimeError(f"{tree} {variant}: no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the baseline checkout (native extension built in place)")
    p.add_argument("--new", default=os.path.dirname(HERE), help="the changed checkout")
    p.add_argument("--variants", nargs="+", default=["bf16", "int8", "int4_g32"],
                   help="bf16, or quantization variants as benchmarks/common.py quant_variant names them")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="the small model (a smoke run)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=16, help="--device cuda: the 7B-shaped model's layers")
    p.add_argument("--out", help="write every round's numbers here (JSON)")
    args = p.parse_args(argv)
    spin_openmp()
    if args.device == "cuda":
        spec = dict(hidden_size=4096, num_layers=args.layers, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                    vocab=32000)
    else:
        spec = QUICK if args.quick else FULL
    src = build_model(spec, "bfloat16")
    rows = {v: {"old": [], "new": []} for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for which in order:
                rows[v][which].append(run_tree(getattr(args, which), src, v, args.tokens, args.device))
            print(f"round {r + 1}: {v} old {rows[v]['old'][-1]:.2f} new {rows[v]['new'][-1]:.2f} tokens/s", flush=True)
    summary = {v: statistics.median(n / o for n, o in zip(rows[v]["new"], rows[v]["old"])) for v in rows}
    for v, ratio in summary.items():
        print(f"{v:>10}: new/old {ratio:.3f} (median of {args.rounds} same-round ratios)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "rounds": rows, "median_ratio": summary,
                       "time": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
