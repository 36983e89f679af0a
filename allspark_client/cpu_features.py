"""The CPU's feature flags (avx2, avx512f, avx512_vnni, ...), read once per process.

On Linux from /proc/cpuinfo's `flags` line (microseconds); elsewhere from py-cpuinfo, whose probe runs a
subprocess and takes ~1.5 s. Torch-free: the launcher (allspark_client) and the kernels' ISA choice
(allspark_server/compute/ops.py) both use it.
"""
from __future__ import annotations

import functools

PROC_CPUINFO = "/proc/cpuinfo"


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


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
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
