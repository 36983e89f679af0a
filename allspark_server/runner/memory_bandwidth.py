"""Memory bandwidth: a STREAM-like copy measurement (the roofline of a memory-bound decode step) and the bytes a
decode step reads, for the live memory-bandwidth utilisation (MBU) that `get_as_engine_stat` reports.

MBU = bytes a decode step reads (every weight once, the embedding table one row unless the LM head reads it whole,
plus each sequence's KV cache) / the step's wall time / the copy bandwidth measured here: the same definition as
the benchmark's "batch-1 decode / roofline" ratio (benchmarks/run.py), with the same statistic (the median copy).
In a pool every rank measures its own, all ranks at once (install_runner), so ranks that share a memory
controller each see their share of it and ranks on separate NUMA nodes or GPUs see their own.
"""
from __future__ import annotations

import glob
import os
import statistics
import time
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Optional

import torch

from allspark_client import settings
from allspark_server.compute.device_kind import DeviceKind
from allspark_server.layers.rotary import RotaryEmbedding
from allspark_server.step.hugepages import to_hugepages

_measured: dict[str, float] = {}


def arrays(floats: int, *fills: Optional[float]) -> list[torch.Tensor]:
    """fp32 arrays of `floats` each in the engine's page size (weights live in huge pages, where copies run faster,
    so the roofline is measured in them too). A fill of None leaves it uninitialised."""
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


def last_level_cache_bytes() -> int:
    """The machine's L3 caches together (each distinct one once, from sysfs), 0 where sysfs does not say."""
    seen: dict[str, int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index3"):
        try:
            with open(os.path.join(index, "shared_cpu_list")) as f:
                shared = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        seen[shared] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sum(seen.values())


def copy_floats() -> int:
    """Floats per array of the copy: each array twice every L3 of the machine together (the copy's two arrays are 4x
    what the caches hold), at least 16 Mi (64 MB: larger arrays read the same GB/s but take longer to fault their
    huge pages in at every install; docs/performance.md, "Choices in the code")."""
    return max(16 << 20, 2 * last_level_cache_bytes() // 4)


def copy_bandwidth_gbs(floats: Optional[int] = None, repeats: int = 5) -> float:
    """GB/s moved by a copy c = a (bytes read + written, STREAM's convention) with torch's threads, median run."""
    a, c = arrays(floats or copy_floats(), 1.0, None)
    return 2 * a.numel() * 4 / median_time(lambda: c.copy_(a), repeats) / 1e9


def bandwidth_gbs(kind: DeviceKind) -> float:
    """The copy bandwidth of the memory a device of `kind` decodes from, measured once per process and device
    (~0.2-0.5 s; ALLSPARK_MEMORY_BANDWIDTH_GBS overrides): a device-to-device copy timed by the device where it
    times its own (compute/cuda/cuda_device.py), else host RAM's, the median of 9 copies, as the benchmark's
    roofline: on a shared VM the best one reads well above the bandwidth the decode runs around it see
    (docs/performance.md, "Choices in the code")."""
    key = str(kind.device)
    if key not in _measured:
        given = settings.MEMORY_BANDWIDTH_GBS.get()
        if given is not None:
            _measured[key] = given
        elif kind.bandwidth_timed_on_device:
            _measured[key] = kind.copy_bandwidth_gbs()
        else:
            _measured[key] = copy_bandwidth_gbs(repeats=9)
    return _measured[key]


@dataclass(frozen=True)
class DecodeBytes:
    """One rank's share of a decode step: bytes of weights it reads, KV bytes per context token, its bandwidth."""
    weights: int
    kv_per_token: int
    bandwidth_gbs: float

    def read_bytes(self, steps: int, context_tokens: int) -> int:
        """What `steps` decode steps read on this rank, their sequences' contexts summing to `context_tokens`."""
        return steps * self.weights + context_tokens * self.kv_per_token


def decode_weight_bytes(model: torch.nn.Module, embedding: torch.Tensor) -> int:
    """Bytes of weights one decode step reads on this rank: every parameter and weight buffer once (tensors over the
    same memory once), the embedding table one row (its lookup) and a tied LM head, which is the table or (on more
    ranks) a slice of its rows, the rows it reads; rotary tables (of which a step reads a row per token) and scalar
    buffers (an embedding scale) out."""
    rotary = {id(t) for m in model.modules() if isinstance(m, RotaryEmbedding) for t in m.buffers()}
    tensors = [t for _, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers())
               if id(t) not in rotary and t.dim() > 0]
    total, counted, looked_up = 0, set(), False
    for t in tensors:
        if t is embedding and not looked_up:
            looked_up = True
            total += t.shape[-1] * t.element_size()
            continue
        key = (t.data_ptr(), t.nbytes)      # a tensor is its memory: a head tied by sharing it is read in full
        if key not in counted:
            counted.add(key)
            total += t.numel() * t.element_size()
    return total
