"""Machine measurements for the roofline: STREAM-like copy/triad bandwidth and matmul rates,
with the thread count the engine uses."""
from __future__ import annotations

import time

import torch

ARRAY_FLOATS = 64 << 20   # 256 MiB per array: far beyond any cache


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def stream_bandwidth(repeats: int = 5) -> dict:
    """GB/s moved (bytes read + written), STREAM's convention: copy c=a, triad a=b+s*c."""
    a = torch.ones(ARRAY_FLOATS)
    b = torch.full_like(a, 2.0)
    c = torch.empty_like(a)
    nbytes = a.numel() * 4
    copy = 2 * nbytes / _best_time(lambda: c.copy_(a), repeats)
    triad = 3 * nbytes / _best_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return {"copy_gbs": copy / 1e9, "triad_gbs": triad / 1e9}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    x = torch.randn(n, n).to(dtype)
    y = torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _best_time(lambda: x @ y, repeats) / 1e9
