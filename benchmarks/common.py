"""What every benchmark script shares: where results go and what the machine is called in their names.

Imports no torch at module level and no other benchmark module, so any script can import it first (before torch
loads). A result is `benchmarks/results/<measure>-<machine>.json`: one current file per measure and machine kind,
older ones left to git history; `results_table.py` turns the folder into RESULTS.md. `--quick` runs write under
`results/quick/`, which git ignores, so a smoke run never replaces a current result.
"""
from __future__ import annotations

import json
import os
import platform
import re

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_kind() -> str:
    """The CPU's short name from its flags: 'spr' (AMX), 'zen4' (AMD with AVX-512), 'avx512' (other AVX-512),
    'avx2', else the architecture (platform.machine())."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.machine().lower() or "cpu"
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    if {"amx_bf16", "amx_int8"} & flags:
        return "spr"
    if "avx512f" in flags:
        return "zen4" if "AuthenticAMD" in info else "avx512"
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
