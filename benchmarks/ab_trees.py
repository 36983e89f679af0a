"""Same-run A/B of two source trees: batch-1 decode tokens/s of the benchmark model, each tree's Engine resident in
its own process, the two taking turns (A, B, B, A, A, B, ...) so that the machine's drift hits both alike.

    python benchmarks/ab_trees.py --old /path/to/old/checkout --new . --variants bf16 int8 int4_g32 --turns 15
    python benchmarks/ab_trees.py --old /path/to/old/checkout --device cuda --variants bf16 --turns 9

On a CPU each tree must have its native extension built in place; on a GPU (--device cuda) the model has
Llama-2-7B's shapes with --layers layers (16 by default: a bandwidth-bound batch-1 step of ~6.5 GB); --smoke: the tiny
model (common.SMOKE) on either.
Per variant, each tree serializes the model once (cached under ~/.cache/allspark/ab) and installs it in an
Engine that stays up; then each turn decodes `--tokens` tokens after a 32-token prompt in one tree and then the
other (the first turn of each warms up and is dropped), timing the decode: tokens after the first over the time
since the first arrived. A shared VM's slow spells last longer than a turn, so each pair of adjacent runs sees the
same machine; the median of the per-turn new/old ratios is reported. --out writes every number.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import add_smoke_flag, build_model, quant_variant, spec_of  # noqa: E402

WORKER = r"""
import json, os, sys, time
from allspark_server import Engine, HuggingFaceModel
src, variant, tokens, cache, quant, device = (sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5],
                                              sys.argv[6])
quant = json.loads(quant)
name = "ab"
loader = HuggingFaceModel(src, name, user_set_data_type="bfloat16")
out = os.path.join(cache, variant)
if not os.path.exists(os.path.join(out, name + ".asparam")):
    loader.load_model()
    loader.serialize(None, model_output_dir=out,
                     **({"enable_quant": True, "customized_quant_config": quant} if quant else {}))
    loader.free_model()
else:
    loader.graph_path, loader.weights_path = os.path.join(out, name + ".asgraph"), os.path.join(out, name + ".asparam")
engine = Engine()
cfg = (loader.create_reference_runtime_config_builder(name, device, [0], max_batch=1)
       .max_length(64 + tokens).kv_cache_span_size(32).build())
engine.install_model(cfg)
engine.start_model(name)
print("AB_READY", flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    gen = {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []}
    start = time.perf_counter()
    status, handle, queue = engine.start_request(name, {"input_ids": list(range(3, 35))}, gen)
    first, n = None, 0
    while n < tokens:
        el = queue.Get()
        if el is None:
            break
        if first is None:
            first, n_first = time.perf_counter(), len(el.ids_from_generate)
        n += len(el.ids_from_generate)
    end = time.perf_counter()
    # tokens after the first over the time since it came; all in one element (a slow reader): every token over the
    # whole request's time
    rate = (n - n_first) / (end - first) if n > n_first else n / (end - start)
    engine.release_request(name, handle)
    print("AB_RESULT " + json.dumps(rate), flush=True)
engine.stop_model(name)
engine.release_model(name)
engine.shutdown()
"""


class Tree:
    """One tree's Engine in its own process, decoding on request."""

    def __init__(self, tree: str, src: str, variant: str, tokens: int, device: str):
        tree = os.path.abspath(tree)
        key = hashlib.sha256(f"{tree}|{os.path.abspath(src)}".encode()).hexdigest()[:8]   # the same in every run
        cache = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "ab", f"{os.path.basename(tree)}-{key}")
        quant = quant_variant(variant) if variant != "bf16" else {}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
        self.name = tree
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, src, variant, str(tokens), cache,
                                      json.dumps(quant), device], cwd=tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._expect("AB_READY")

    def _expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"{self.name}: the worker ended (exit {self.proc.wait()}) before {tag}")

    def decode(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("AB_RESULT"))

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the baseline checkout (native extension built in place)")
    p.add_argument("--new", default=os.path.dirname(HERE), help="the changed checkout")
    p.add_argument("--variants", nargs="+", default=["bf16", "int8", "int4_g32"],
                   help="bf16, or quantization variants as benchmarks/common.py quant_variant names them")
    p.add_argument("--turns", type=int, default=15, help="timed decodes per tree and variant")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="the small model")
    add_smoke_flag(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=16, help="--device cuda: the 7B-shaped model's layers")
    p.add_argument("--out", help="write every round's numbers here (JSON)")
    args = p.parse_args(argv)

    if args.device == "cuda" and not args.smoke:
        spec = dict(hidden_size=4096, num_layers=args.layers, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                    vocab=32000)
    else:
        spec = spec_of(args)
    src = build_model(spec, "bfloat16")
    rows = {v: {"old": [], "new": []} for v in args.variants}
    for v in args.variants:
        trees = {which: Tree(getattr(args, which), src, v, args.tokens, args.device) for which in ("old", "new")}
        try:
            for turn in range(args.turns + 1):
                for which in (("old", "new") if turn % 2 == 0 else ("new", "old")):
                    rate = trees[which].decode()
                    if turn:                                      # turn 0 warms both up
                        rows[v][which].append(rate)
                if turn:
                    print(f"{v} turn {turn}: old {rows[v]['old'][-1]:.2f} new {rows[v]['new'][-1]:.2f} tokens/s",
                          flush=True)
        finally:
            for t in trees.values():
                t.close()
    summary = {v: statistics.median(n / o for n, o in zip(rows[v]["new"], rows[v]["old"])) for v in rows}
    for v, ratio in summary.items():
        print(f"{v:>10}: new/old {ratio:.3f} (median of {args.turns} per-turn ratios)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "trees": {"old": args.old, "new": args.new}, "turns": rows,
                       "median_ratio": summary, "time": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
