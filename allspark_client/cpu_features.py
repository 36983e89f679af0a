"""The CPU's feature flags (avx2, avx512f, avx512_vnni, ...), read once per process.

On Linux from /proc/cpuinfo's `flags` line (microseconds); elsewhere from py-cpuinfo, whose probe runs a
subprocess and takes ~1.5 s. Torch-free: the launcher (allspark_client) and the kernels' ISA choice
(allspark_server/compute/ops.py) both use it. ALLSPARK_CPU_ISA hides the features above a level, so one CPU can
run as an older kind would.
"""
from __future__ import annotations

import functools

from allspark_client import settings

PROC_CPUINFO = "/proc/cpuinfo"
# ALLSPARK_CPU_ISA's levels, oldest first; a flag belongs to the first level that has it (flag_level), a flag
# not named there to every level, and AMX to none (only "auto" keeps it)
LEVELS = ("portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
AMX_LEVEL = len(LEVELS)


def parse_proc_cpuinfo(text: str) -> frozenset:
    """The flags of the first processor in a /proc/cpuinfo text (x86: `flags`, ARM: `Features`)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# py-cpuinfo's names (from cpuid) of the features whose /proc/cpuinfo names carry an underscore
CPUINFO_SPELLINGS = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
                     "avxvnni": "avx_vnni", "amxbf16": "amx_bf16", "amxint8": "amx_int8", "amxtile": "amx_tile"}


def normalized(flags) -> frozenset:
    """The flags in /proc/cpuinfo's spelling, whichever source named them, so each consumer checks one name."""
    return frozenset(CPUINFO_SPELLINGS.get(f, f) for f in flags)


def flag_level(flag: str) -> int:
    """The first of LEVELS whose CPUs have this flag (AVX-VNNI, AVX2's encoding of VNNI, came with AVX-512 VNNI
    on the CPUs we meet; the AVX2-only kinds lack it)."""
    if flag.startswith("amx"):
        return AMX_LEVEL
    if flag in ("avx512_bf16", "avx512_fp16"):
        return LEVELS.index("avx512_bf16")
    if flag in ("avx512_vnni", "avx_vnni"):
        return LEVELS.index("avx512_vnni")
    if flag.startswith("avx512"):
        return LEVELS.index("avx512")
    if flag in ("avx", "avx2", "fma", "f16c"):
        return LEVELS.index("avx2")
    return 0


def capped(flags: frozenset, level: str) -> frozenset:
    """The flags a CPU shows at most `level` of (ALLSPARK_CPU_ISA; "auto": all of them)."""
    if level == "auto":
        return flags
    top = LEVELS.index(level)
    return frozenset(f for f in flags if flag_level(f) <= top)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """The CPU's flags as the kernels may use them: capped at ALLSPARK_CPU_ISA."""
    return capped(reported_flags(), settings.CPU_ISA.get())


def reported_flags() -> frozenset:
    try:
        with open(PROC_CPUINFO) as f:
            flags = parse_proc_cpuinfo(f.read())
        if flags:
            return flags
    except OSError:
        pass
    try:
        import cpuinfo
        return normalized(cpuinfo.get_cpu_info().get("flags", []))
    except Exception:
        return frozenset()
