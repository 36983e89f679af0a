"""Machine measurements for the roofline: STREAM-like copy/triad bandwidth and matmul rates,
with the thread count the engine uses."""
from __future__ import annotations

import statistics
import time

import torch

from allspark_server.runner.hugepages import to_hugepages

ARRAY_FLOATS = 64 << 20   # 256 MiB per array: far beyond any cache


def _arrays(*fills: float | None) -> list[torch.Tensor]:
    """fp32 arrays in the engine's page size: it keeps weights in huge pages (runner/hugepages.py), and
    copies run ~3-4% faster in them here, so the roofline is measured in them too."""
    arrays = {str(i): torch.empty(ARRAY_FLOATS) if f is None else torch.full((ARRAY_FLOATS,), f)
              for i, f in enumerate(fills)}
    return list(to_hugepages(arrays).values())


def _median_time(fn, repeats: int) -> float:
    """Median, not best: on a shared machine the best run catches moments when the neighbours are
    idle, which the engine's runs (seconds long) do not get."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stream_bandwidth(repeats: int = 7) -> dict:
    """GB/s moved (bytes read + written), STREAM's convention: copy c=a, triad a=b+s*c."""
    a, b, c = _arrays(1.0, 2.0, None)
    triad = 3 * a.numel() * 4 / _median_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return {"copy_gbs": copy_bandwidth(repeats), "triad_gbs": triad / 1e9}


def copy_bandwidth(repeats: int = 5) -> float:
    """Copy GB/s right now (also measured around the decode runs of each round, so a round's roofline
    uses the bandwidth the machine had then)."""
    a, c = _arrays(1.0, None)
    return 2 * a.numel() * 4 / _median_time(lambda: c.copy_(a), repeats) / 1e9


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
