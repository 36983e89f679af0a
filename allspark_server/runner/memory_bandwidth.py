"""Memory bandwidth: a STREAM-like copy measurement (the roofline of a memory-bound decode step) and the bytes a
decode step reads, for the live memory-bandwidth utilisation (MBU) that `get_as_engine_stat` reports.

MBU = bytes a decode step reads (every weight once, the embedding table one row unless the LM head reads it whole,
plus each sequence's KV cache) / the step's wall time / the copy bandwidth measured here: the same definition as
the benchmark's "batch-1 decode / roofline" ratio (benchmarks/run.py).
"""
from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from itertools import chain
from typing import Callable, Optional

import torch

from allspark_server.runner.hugepages import to_hugepages

_measured: dict[str, float] = {}


def arrays(floats: int, *fills: Optional[float]) -> list[torch.Tensor]:
    """fp32 arrays of `floats` each in the engine's page size (weights live in huge pages, copies run ~3-4% faster
    in them on the VMs measured, so the roofline is measured in them too). A fill of None leaves it uninitialised."""
    out = {str(i): torch.empty(floats) if f is None else torch.full((floats,), f) for i, f in enumerate(fills)}
    return list(to_hugepages(out).values())


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of `repeats` timed calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median call (not the best: on a shared machine the best run catches moments when the neighbours are
    idle, which long engine runs do not get)."""
    return statistics.median(_times(fn, repeats))


def copy_bandwidth_gbs(floats: int = 64 << 20, repeats: int = 5, best: bool = False) -> float:
    """GB/s moved by a copy c = a (bytes read + written, STREAM's convention) with torch's threads; the median
    run's, or with `best` the fastest run's (what the memory can do when nothing else interferes)."""
    a, c = arrays(floats, 1.0, None)
    times = _times(lambda: c.copy_(a), repeats)
    return 2 * a.numel() * 4 / (min(times) if best else statistics.median(times)) / 1e9


def gpu_copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The GPU's device-to-device copy GB/s (read + written), timed with CUDA events."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def bandwidth_gbs(device: torch.device) -> float:
    """The copy bandwidth of the memory `device` decodes from, measured once per process and device (~0.5 s;
    ALLSPARK_MEMORY_BANDWIDTH_GBS overrides)."""
    key = str(device)
    if key not in _measured:
        env = os.environ.get("ALLSPARK_MEMORY_BANDWIDTH_GBS")
        if env:
            _measured[key] = float(env)
        elif device.type == "cuda":
            _measured[key] = gpu_copy_bandwidth_gbs(device)
        else:
            _measured[key] = copy_bandwidth_gbs(repeats=9, best=True)
    return _measured[key]


def decode_weight_bytes(model: torch.nn.Module, embedding: torch.Tensor) -> int:
    """Bytes of weights one decode step reads on this rank: every parameter and weight buffer once (tied tensors
    once), the embedding table one row unless another tensor (a tied LM head) reads it whole; rotary tables out."""
    tensors = [t for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers())
               if "rotary" not in name]
    uses = Counter(t.data_ptr() for t in tensors)
    total, counted = 0, set()
    for t in tensors:
        ptr = t.data_ptr()
        if ptr in counted:
            continue
        counted.add(ptr)
        one_row = t is embedding and uses[ptr] == 1
        total += (t.shape[-1] if one_row else t.numel()) * t.element_size()
    return total
