"""Resident memory of one rank installed from model files, per weight format.

    python benchmarks/install_memory.py [--quick] [--variants bf16 int8 uint4_g32] [--json PATH]

The benchmark model (common.FULL; --quick: common.QUICK; --smoke: common.SMOKE) is serialized once per variant;
then each variant is installed by a fresh `python benchmarks/install_memory.py --child GRAPH PARAMS` process (CPU,
one rank, a small KV cache) that reports its RSS (psutil) after its imports, after `install_model` (the weights and
the KV cache are in place then) and after `start_model`, with the bytes of the rank's weight tensors, the KV cache's
bytes and /proc/self/smaps_rollup's split of the RSS (anonymous / file-backed). A well-behaved install holds its
baseline + weight bytes + KV bytes and little more (tests/models/test_install_memory.py asserts it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import workloads as W

VARIANTS = ("bf16", "int8", "int8_g32", "int4_g32", "uint4_g32")
MB = 1 << 20


def smaps_rollup() -> dict[str, int]:
    """/proc/self/smaps_rollup's Rss split, in bytes ({} where the file does not exist)."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty", "AnonHugePages"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def peak_rss() -> int:
    """The process's peak RSS so far (VmHWM), in bytes; 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return 0


def rank_tensor_bytes(module) -> int:
    """Bytes of a model's parameters and buffers, memory that several share (a tied head's rows of the embedding)
    once: the union of their byte ranges."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in list(module.parameters()) + list(module.buffers()))
    total, end = 0, 0
    for lo, hi in spans:
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def child(graph: str, params: str, max_batch: int, max_length: int, prompt: int = 0) -> dict:
    """Install the model files on CPU in this (fresh) process and report what it holds at each step."""
    import psutil
    proc = psutil.Process()
    import torch

    from allspark_client.config import AsModelRuntimeConfigBuilder
    from allspark_server import Engine
    torch.set_num_threads(1)
    rss = {"imports": proc.memory_info().rss}
    cfg = (AsModelRuntimeConfigBuilder().model_name("m").model_file_path(graph, params).compute_unit("CPU", [0])
           .max_batch(max_batch).max_length(max_length).kv_cache_span_size(32).build())
    engine = Engine()
    try:
        assert engine.install_model(cfg) == 0, engine.get_last_error()
        rss["install"] = proc.memory_info().rss
        smaps, peak = smaps_rollup(), peak_rss()
        assert engine.start_model("m") == 0, engine.get_last_error()
        rss["start"] = proc.memory_info().rss
        runner = engine._models["m"].runner
        if prompt:        # one greedy request: what serving adds (activations, a prefill's dequantized weights)
            ids = W.prompt(prompt, 0, min(1000, runner.args.vocab_size))
            W.greedy_tokens(engine, "m", ids, min(16, max_length - prompt))
            rss["request"] = proc.memory_info().rss
        return {"rss": rss, "smaps_after_install": smaps, "peak_rss_install": peak,
                "weight_bytes": rank_tensor_bytes(runner.model),
                "kv_bytes": runner.kv_cache_bytes, "file_bytes": os.path.getsize(params)}
    finally:
        engine.shutdown()


def measure(graph: str, params: str, max_batch: int = 1, max_length: int = 256, prompt: int = 0) -> dict:
    """`child` in a fresh interpreter (its baseline is only the imports): its report."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", graph, params,
                           "--max-batch", str(max_batch), "--max-length", str(max_length), "--prompt", str(prompt)],
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"install_memory child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def overhead(report: dict) -> int:
    """RSS after install beyond the baseline, the weights and the KV cache."""
    r = report["rss"]
    return r["install"] - r["imports"] - report["weight_bytes"] - report["kv_bytes"]


def serialize(hf_dir: str, variant: str, out_dir: str) -> tuple[str, str]:
    """The benchmark model's files in `variant` (bf16: unquantized): (graph, params)."""
    from allspark_server import HuggingFaceModel
    m = HuggingFaceModel(hf_dir, f"install-memory-{variant}", user_set_data_type="bfloat16")
    quant = None if variant == "bf16" else common.quant_variant(variant)
    m.load_model().serialize_to_path(None, out_dir, enable_quant=quant is not None, customized_quant_config=quant,
                                     skip_if_exists=True).free_model()
    return m.graph_path, m.weights_path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("GRAPH", "PARAMS"), help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128,
                    help="then one greedy request of this many prompt tokens (0: none), RSS after it")
    ap.add_argument("--quick", action="store_true")
    common.add_smoke_flag(ap)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child, a.max_batch, a.max_length, a.prompt)))
        return
    spec = common.spec_of(a)
    hf_dir = common.build_model(spec, "bfloat16")
    report = {}
    print(f"{'variant':<10} {'file MB':>8} {'weights':>8} {'KV MB':>6} {'imports':>8} {'install':>8} {'start':>8} "
          f"{'request':>8} {'over MB':>8} {'peak':>6}  (MB = 2^20 bytes; over: install - imports - weights - KV)")
    for variant in a.variants:
        graph, params = serialize(hf_dir, variant, os.path.join(hf_dir, "install_memory"))
        r = report[variant] = measure(graph, params, a.max_batch, a.max_length, a.prompt)
        print(f"{variant:<10} {r['file_bytes'] / MB:8.0f} {r['weight_bytes'] / MB:8.0f} {r['kv_bytes'] / MB:6.1f} "
              + " ".join(f"{r['rss'].get(k, 0) / MB:8.0f}" for k in ("imports", "install", "start", "request"))
              + f" {overhead(r) / MB:8.1f} {r['peak_rss_install'] / MB:6.0f}", flush=True)
    if a.json:
        common.write_report(a.json, {"quick": a.quick, "variants": report})


if __name__ == "__main__":
    main()
