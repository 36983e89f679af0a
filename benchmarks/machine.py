"""Machine measurements for the roofline: STREAM-like copy/triad bandwidth and matmul rates,
with the thread count the engine uses."""
from __future__ import annotations

import time

import torch

from allspark_server.runner.memory_bandwidth import arrays, copy_bandwidth_gbs
from allspark_server.runner.memory_bandwidth import median_time as _median_time

ARRAY_FLOATS = 64 << 20   # 256 MiB per array: far beyond any cache


def _arrays(*fills: float | None) -> list[torch.Tensor]:
    return arrays(ARRAY_FLOATS, *fills)


def stream_bandwidth(repeats: int = 7) -> dict:
    """GB/s moved (bytes read + written), STREAM's convention: copy c=a, triad a=b+s*c."""
    a, b, c = _arrays(1.0, 2.0, None)
    triad = 3 * a.numel() * 4 / _median_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return {"copy_gbs": copy_bandwidth(repeats), "triad_gbs": triad / 1e9}


def copy_bandwidth(repeats: int = 5) -> float:
    """Copy GB/s right now (also measured around the decode runs of each round, so a round's roofline
    uses the bandwidth the machine had then)."""
    return copy_bandwidth_gbs(ARRAY_FLOATS, repeats)


def matmul_gflops(dtype: torch.dtype, max_n: int = 2048, repeats: int = 3) -> float:
    """Square matmul rate, n doubled from 256 up to max_n while a call takes under 50 ms. (Without AVX-512
    bf16 instructions, oneDNN's bf16 matmul ran ~50x below fp32 on a Zen 3-class VM: a fixed 2048^3 took
    minutes of the benchmark.)"""
    n = 256
    while True:
        x = torch.randn(n, n).to(dtype)
        y = torch.randn(n, n).to(dtype)
        t = time.perf_counter()
        x @ y
        if time.perf_counter() - t > 0.05 or n >= max_n:
            break
        n *= 2
    return 2 * n ** 3 / _median_time(lambda: x @ y, repeats) / 1e9
