"""What the benchmark scripts share: the CPU benchmark model, the quantization variants' names, a report's bytes per
token, where results go and what the machine is called in their names.

The bottom of benchmarks/: imports no other benchmark module and no torch at module level, so a script can import
it first and call spin_openmp() before torch loads. A result is `benchmarks/results/<measure>-<machine>.json`: one
current file per measure and machine kind, older ones left to git history; results_table.py turns the folder into
RESULTS.md. `--quick` runs write under `results/quick/`, which git ignores, so a smoke run never replaces a result.
"""
from __future__ import annotations

import json
import os
import platform
import re
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The CPU benchmark model (Llama architecture, random weights): about 0.5 B parameters; QUICK a small one.
FULL = dict(hidden_size=1536, num_layers=16, intermediate_size=4096, num_heads=12, num_kv_heads=4, vocab=32000,
            new_tokens=128, prompts=(128, 512, 2048), repeats=5, decode_repeats=7, concurrency=(8, 32), poisson_n=32,
            kv_context=2048)   # kv_context: the --kv rows' prompt length
QUICK = dict(hidden_size=512, num_layers=4, intermediate_size=1408, num_heads=8, num_kv_heads=4, vocab=8000,
             new_tokens=32, prompts=(128, 512), repeats=2, decode_repeats=3, concurrency=(8,), poisson_n=8,
             kv_context=512)
# SMOKE: a tiny model and one round of everything (`--smoke`): checks that a script's every path still runs (the
# CI smoke tests, tests/models/test_benchmark_smoke.py); its numbers mean nothing. The longest prompt is 128 tokens,
# what the concurrency and Poisson rows send
SMOKE = dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab=512,
             new_tokens=8, prompts=(16, 128), repeats=1, decode_repeats=1, concurrency=(2,), poisson_n=2,
             kv_context=32)


def add_smoke_flag(p) -> None:
    """A script's --smoke flag (see SMOKE)."""
    p.add_argument("--smoke", action="store_true", help="a tiny model and one round: checks that the script runs "
                   "(its numbers mean nothing; a default result path is under results/quick/, as --quick's)")


def spec_of(a) -> dict:
    """The benchmark model's spec for a script's flags: SMOKE, QUICK or FULL."""
    return SMOKE if getattr(a, "smoke", False) else QUICK if getattr(a, "quick", False) else FULL


def spin_openmp() -> None:
    """Bounded spinning for every OpenMP team of this process and the processes it starts; call before torch loads.

    transformers runs in the benchmark's process next to the Engine, whose engine thread uses OpenMP too (prefill
    GEMMs): libgomp then manages more threads than there are CPUs and stops letting idle workers spin, so each of
    transformers' parallel regions waits for a wake-up (its batch-1 decode ~10% slower), an artefact of sharing
    the process. Spinning gives transformers (and our prefill) their best case; our decode kernels run on
    allspark's own worker pool and do not depend on it. An explicit setting in the environment wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")


# what runs a process as on an AVX2-only CPU: ATen, oneDNN and MKL capped at AVX2, and allspark's kernels and GEMM
# dtypes chosen as for one (ALLSPARK_CPU_ISA)
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ALLSPARK_CPU_ISA": "avx2"}


def _under_avx2_caps() -> bool:
    return all(os.environ.get(k) == v for k, v in AVX2_CAPS.items())


def as_avx2_if_asked(flag: str = "--as-avx2") -> None:
    """With `flag` on the command line, run this script again under AVX2_CAPS unless it already is; call before
    torch loads (the libraries read their caps once). An indication for AVX2-only machines from a newer one: their
    own cores and memory differ."""
    if flag in sys.argv[1:] and not _under_avx2_caps():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_CAPS})


def check_as_avx2(asked: bool, device: str = "cpu") -> None:
    """A main() called with --as-avx2 from another process's code (not through as_avx2_if_asked) is refused: the
    caps must be set before torch loads. So is --as-avx2 with a `device` other than the CPU."""
    if asked and device != "cpu":
        raise SystemExit("--as-avx2 is for --device cpu")
    if asked and not _under_avx2_caps():
        raise SystemExit("--as-avx2 takes effect as the script starts: run it as a script, or set common.AVX2_CAPS "
                         "in the environment before torch loads")


def build_model(spec: dict, dtype: str) -> str:
    """The benchmark model of `spec` as an HF folder under ~/.cache/allspark/bench (built once): its path."""
    from allspark_server.loader.tiny_model import build_tiny_model
    key = "-".join(str(spec[k]) for k in ("hidden_size", "num_layers", "intermediate_size", "vocab"))
    scales = {k: spec[k] for k in ("weight_scale", "embedding_scale") if k in spec}   # default: 0.02 everywhere
    key += "".join(f"-{k[0]}{v:g}" for k, v in scales.items())
    d = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench", f"{key}-{dtype}")
    if not os.path.exists(os.path.join(d, "config.json")):
        build_tiny_model(d, "llama_gqa_llama3", seed=0, hidden_size=spec["hidden_size"],
                         num_layers=spec["num_layers"], intermediate_size=spec["intermediate_size"],
                         num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"], vocab_size=spec["vocab"],
                         max_position_embeddings=4096, weight_scale=scales.get("weight_scale", 0.02),
                         embedding_scale=scales.get("embedding_scale"), dtype=dtype, tokenizer=False)
    return d


def runtime_cfg(loader, name: str, spec: dict, max_batch: int):
    """A runtime config for `loader`'s model on one rank of the spec's "device" (CPU where it names none), long
    enough for the spec's longest prompt and its tokens."""
    device = spec.get("device", "cpu")
    return (loader.create_reference_runtime_config_builder(name, device, [0], max_batch=max_batch)
            .max_length(max(spec["prompts"]) + spec["new_tokens"] + 8).kv_cache_span_size(32).build())


def quant_variant(name: str) -> dict:
    """'int8' -> int8 per channel; 'uint4_g32' -> uint4 in groups of 32; suffixes: '+head' quantizes the LM
    head too, '+a8' computes with int8 activations (compute_method activate_quant); the customized_quant_config."""
    base, *suffixes = name.split("+")
    unknown = set(suffixes) - {"head", "a8"}
    if unknown:
        raise SystemExit(f"--quant {name}: unknown suffix {sorted(unknown)} (known: +head, +a8)")
    fmt, _, group = base.partition("_g")
    return {"weight_format": fmt, "group_size": int(group) if group else -1, "quantize_lm_head": "head" in suffixes,
            "compute_method": "activate_quant" if "a8" in suffixes else "weight_only"}


def bytes_per_token(hf_model, spec: dict, ctx: int) -> int:
    """Weights read for one decode token (the embedding table contributes one row) + the KV cache."""
    total = 0
    for name, p in hf_model.named_parameters():
        total += p.element_size() * (p.shape[-1] if "embed_tokens" in name else p.numel())
    if hf_model.config.tie_word_embeddings:
        total += hf_model.model.embed_tokens.weight.numel() * hf_model.model.embed_tokens.weight.element_size()
    head_dim = spec["hidden_size"] // spec["num_heads"]
    kv = 2 * spec["num_layers"] * ctx * spec["num_kv_heads"] * head_dim * hf_model.dtype.itemsize
    return total + kv


def file_bytes_per_token(weights_path: str, ctx_bytes: int) -> int:
    """Bytes a decode token reads from a serialized model: every stored tensor once, the embedding one row
    (tied LM heads are read from it in full), plus the KV cache bytes `ctx_bytes`."""
    from safetensors import safe_open
    total = 0
    with safe_open(weights_path, framework="pt") as f:
        names = set(f.keys())
        for name in names:
            sl = f.get_slice(name)
            shape, size = sl.get_shape(), sl.get_dtype()
            elem = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}[size]
            n = 1
            for d in shape:
                n *= d
            own_head = "lm_head.weight" in names or "lm_head.qweight" in names
            total += elem * (shape[-1] if "embed_tokens" in name and own_head else n)
    return total + ctx_bytes


def machine_name() -> str:
    """The CPU's brand string (py-cpuinfo where installed), for a report's "machine"."""
    try:
        import cpuinfo
        return cpuinfo.get_cpu_info().get("brand_raw", platform.processor())
    except Exception:
        return platform.processor()


def cpu_kind() -> str:
    """The CPU's short name from its flags: 'spr' (AMX), 'zen4' / 'zen5' (AMD with AVX-512: CPU family 25 / 26),
    'avx512' (other AVX-512), 'avx2', else the architecture (platform.machine())."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.machine().lower() or "cpu"
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    if {"amx_bf16", "amx_int8"} & flags:
        return "spr"
    if "avx512f" in flags:
        if "AuthenticAMD" not in info:
            return "avx512"
        family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
        return "zen5" if family and int(family.group(1)) >= 26 else "zen4"
    if "avx2" in flags:
        return "avx2"
    return platform.machine().lower() or "cpu"


def gpu_kind() -> str:
    """The GPUs' short name: the model ('h100', 'h200', ...) and, with more than one visible, 'x<count>'."""
    import torch
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b([A-Z]\d{2,4})\b", name)
    kind = model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "", name.lower())
    count = torch.cuda.device_count()
    return f"{kind}x{count}" if count > 1 else kind


def machine_kind(device: str = "cpu") -> str:
    return gpu_kind() if device == "cuda" else cpu_kind()


def result_path(measure: str, device: str = "cpu", quick: bool = False) -> str:
    """Where a run of `measure` on this machine writes its report by default."""
    name = f"{measure}-{machine_kind(device)}.json"
    return os.path.join(RESULTS_DIR, "quick", name) if quick else os.path.join(RESULTS_DIR, name)


def write_report(path: str, report: dict) -> None:
    """A benchmark's report as JSON at `path` (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
