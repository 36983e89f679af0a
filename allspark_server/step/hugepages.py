"""Weights and KV cache in transparent huge pages.

Batch-1 decode streams every weight once per token. In 4 KiB pages that is a TLB miss every 4 KiB;
in 2 MiB pages almost none. torch's CPU allocator only asks for huge pages when THP_MEM_ALLOC_ENABLE is
set before its first allocation, which a library cannot rely on, so the runner places a shard's
weights and its KV cache itself: one anonymous mmap advised MADV_HUGEPAGE, each tensor a 4 KiB-aligned
view of it (docs/performance.md, "Choices in the code", has what that gains). Where huge pages are unavailable
(not Linux, THP "never") ordinary torch tensors are used.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

from allspark_server.compute.device_kind import in_host_memory

log = logging.getLogger(__name__)
ALIGN = 4096


def _hugepage_bytes(nbytes: int) -> torch.Tensor | None:
    """A zero-filled uint8 tensor of nbytes over an mmap advised MADV_HUGEPAGE; None if that cannot be had."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:
        return None
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(advice)
    except OSError as e:          # THP disabled in this kernel / container
        log.info("huge pages unavailable (%s): tensors stay in ordinary pages", e)
        buf.close()
        return None
    return torch.frombuffer(buf, dtype=torch.uint8)     # the tensor keeps the mmap alive


def zeros(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], populate: bool = False) -> dict[str, torch.Tensor]:
    """Zero-filled CPU tensors {name: (shape, dtype)}, all in one huge-page arena (torch.zeros if none). populate:
    every page faulted in now (the KV cache: otherwise a decode step that writes a new span's rows waits for the
    kernel to clear a fresh 2 MiB page, while torch.zeros's fallback writes every page anyway)."""
    offsets, total = {}, 0
    for name, (shape, dtype) in specs.items():
        offsets[name] = total
        nbytes = math.prod(shape) * dtype.itemsize
        total += -(-nbytes // ALIGN) * ALIGN
    arena = _hugepage_bytes(total)
    if arena is None:
        return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    if populate:
        arena.zero_()
    return {name: arena[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, (shape, dtype) in specs.items()}


def to_hugepages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values, contiguous, in one huge-page arena; empties `tensors` as it copies, so the
    originals are freed one by one rather than all held until the end."""
    if not all(in_host_memory(t) for t in tensors.values()):
        return tensors
    out = zeros({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    for name in list(tensors):
        out[name].copy_(tensors.pop(name))
    return out
