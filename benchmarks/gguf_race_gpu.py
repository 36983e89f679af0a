"""The GGUF race of gguf_race.py on one GPU: allspark on a CUDA rank against llama.cpp with every layer offloaded.

    python benchmarks/gguf_race_gpu.py [--files smollm2 q8_0+head q4_0+head] [--rounds 5] [--concurrency 8 32]
                                       [--device cuda|cpu] [--quick] [--json PATH] [--append]

The same files, workloads, interleaved rounds and ratios as gguf_race.py (its functions run them): ours installs
the model on GPU 0 (runtime config of compute unit cuda, KV cache for max_batch x max_length), llama.cpp loads the
file with n_gpu_layers=-1 (every layer and the output matrix on the GPU, flash attention on as on the CPU; its
concurrent contexts share that model). There is no waiting for a quiet CPU: both sides run their work on the GPU
(each round still records the cores other processes took). llama-cpp-python must be a CUDA build; the report
records its version, llama.cpp's system info (the backends built in) and the build flags found in the environment
variable LLAMA_BUILD_FLAGS (the CMAKE_ARGS it was built with), the GPU, its driver and torch's CUDA.

--device cpu runs the same code on the CPU (a smoke test where no GPU is). --append adds the files to an existing
report of the same settings, so a race can span several device calls.

llama.cpp built from the llama-cpp-python sdist with CUDA 13's nvcc (cmake -DGGML_CUDA=on, libs copied into the
package's llama_cpp/lib) gave a libggml-cuda.so that exports its own copies of libstdc++'s symbols; with torch
loaded in the same process, llama_model_load then crashed (SIGSEGV in an ostream insert under print_info). Loading
the system libstdc++ first, LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6, binds every library to one copy.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import gguf_race as R
import llamacpp_peer as LP
import torch


def device_info(device: str) -> dict:
    """The GPU, its driver and torch's CUDA (device cuda), or the CPU's name."""
    if device != "cuda":
        return {"device": common.machine_name()}
    import subprocess
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return {"device": torch.cuda.get_device_name(0), "nvidia_smi": smi.stdout.strip() or smi.stderr.strip(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}


def start_report(a, spec: dict) -> dict:
    """A fresh report, or (--append) the one at a.json after checking that it was run with the same settings."""
    info = {**LP.build_info(), "n_gpu_layers": -1 if a.device == "cuda" else 0, "n_batch": R.N_BATCH,
            "n_ubatch": R.N_UBATCH, "slot_ctx": R.SLOT, "kv_unified": False,
            "build_flags": os.environ.get("LLAMA_BUILD_FLAGS")}
    settings = {"device": a.device, "threads": a.threads, "rounds": a.rounds, "new_tokens": spec["new_tokens"],
                "concurrency": a.concurrency, "ttft_prompt": R.TTFT_PROMPT, "stream_prompt": R.CONC_PROMPT,
                "ours": a.ours}
    dev = device_info(a.device)
    fresh = {"machine": dev["device"], "machine_kind": common.machine_kind(a.device), "settings": settings,
             "device_info": dev, "llamacpp": info,
             "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}, "files": {}}
    if not (a.append and os.path.exists(a.json)):
        return fresh
    with open(a.json) as fh:
        old = json.load(fh)
    for key in ("settings", "machine", "llamacpp"):
        if old.get(key) != fresh[key]:
            raise SystemExit(f"--append: {a.json} has other {key} ({old.get(key)} vs {fresh[key]})")
    return {k: v for k, v in old.items() if k in fresh}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", default=["smollm2", "q8_0+head", "q4_0+head"],
                   help="smollm2, or llamacpp_peer ftypes of the 0.5 B benchmark model (q8_0+head, q4_0+head, ...)")
    p.add_argument("--ours", choices=["gguf", "hf"], default="gguf",
                   help="what our side loads for a written file: the .gguf itself, or its HF folder quantized")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of this script")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama.cpp's CPU threads (with every layer offloaded they only look up token embeddings)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--quick", action="store_true", help="the small benchmark model, 32 new tokens")
    common.add_smoke_flag(p)
    p.add_argument("--json", default=None, help="default: benchmarks/results/gguf-race-<gpu>.json "
                   "(--quick: under results/quick/)")
    p.add_argument("--append", action="store_true", help="add the files to the report at --json (same settings)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (use --device cpu for a smoke run)")
    if why_not := LP.missing():
        raise SystemExit(why_not)
    import llama_cpp
    if a.device == "cuda" and not llama_cpp.llama_supports_gpu_offload():
        raise SystemExit("--device cuda: this llama-cpp-python has no GPU backend (build it with "
                         'CMAKE_ARGS="-DGGML_CUDA=on")')
    if a.device == "cuda" and "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
        print("warning: LD_PRELOAD names no libstdc++; a CUDA build of llama.cpp may crash beside torch (see the "
              "module's docstring)", flush=True)
    a.quiet_cores, a.quiet_timeout = 0.0, 0.0       # gguf_race.one_round: no waiting for a quiet CPU
    spec = R.race_spec(a.ours, a.quick, a.smoke, device=a.device)
    a.json = a.json or common.result_path("gguf-race", a.device, a.quick or a.smoke)
    report = start_report(a, spec)
    from allspark_server import Engine
    engine = Engine()
    try:
        for key in a.files:
            report["files"][key] = R.race(key, spec, a, engine)
            common.write_report(a.json, R.finish(report))
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()            # the released model's memory back before the next file
    finally:
        engine.shutdown()
    for key, rep in report["files"].items():
        print(f"{key}: " + ", ".join(f"{R.label(m)} {v:.2f}x" for m, v in rep["ratios"].items()))
        print("  tok/s ours / llama.cpp: " + ", ".join(
            f"{m} {rep['medians']['allspark'][m]:.4g} / {rep['medians']['llamacpp'][m]:.4g}"
            for m in rep["medians"]["allspark"] if not m.endswith("first_tokens_s")))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
