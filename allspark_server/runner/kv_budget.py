"""The KV cache budget of CPU ranks: every rank and every model on one machine draw from the same RAM.

A rank's KV cache is an anonymous mapping whose pages the kernel hands out as requests first write them, so the
RAM it takes shows in MemAvailable only once used: each rank sizing its cache against MemAvailable, and each model
again, promised the same memory over and over (three models with max_batch=10**6 on two ranks each took ~40% of a
24 GiB machine's RAM per rank, and every install succeeded). So each rank keeps a ledger of the KV caches it holds
in host memory (bytes reserved, and how many of them are resident, from mincore), the ranks of a pool exchange
their ledgers at each install, and the ranks on one machine share one budget:

    base  = MemAvailable + the resident bytes of those caches     (the RAM there is for KV caches)
    room  = NODE_KV_FRACTION x base - the bytes those caches reserve

A model's explicit kv_cache_memory_bytes times the pool's ranks on the machine must fit in room, or the install is
refused with the numbers. An automatic budget (max_batch x max_length) takes at most AUTO_KV_MAX_FRACTION x base
and at most room, split between the machine's ranks, and is refused where that cannot hold one request of
max_length. Another pool's caches count only as far as MemAvailable shows them (their touched pages).
"""
from __future__ import annotations

import ctypes
import gc
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Optional

import psutil

from allspark_server.compute.device_kind import in_host_memory

NODE_KV_FRACTION = 0.9      # every KV cache of a pool on one machine together: at most this share of `base`
AUTO_KV_MAX_FRACTION = 0.4  # one model's automatic budget on one machine: at most this share of `base`
GiB = float(1 << 30)


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / (1 << 20):.1f} MiB"

_held: "weakref.WeakSet" = weakref.WeakSet()     # this process's KV caches in host memory (step.kv_cache.KVCache)


def hold(cache) -> None:
    """Count `cache` (a KVCache whose pages are in host memory) until it is freed."""
    _held.add(cache)


def _tensors(cache):
    for layer in cache.layers:
        for t in layer:
            if t is not None:
                yield t


def resident_bytes(ptr: int, nbytes: int) -> Optional[int]:
    """Bytes of [ptr, ptr + nbytes) in RAM (mincore), None where that cannot be asked."""
    if nbytes <= 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = ptr - ptr % page
    length = ptr + nbytes - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            return None
    except (OSError, AttributeError):
        return None
    in_ram = len(vec) - bytes(vec).count(0)
    return min(nbytes, in_ram * page)


@dataclass(frozen=True)
class RankUsage:
    """What one rank's host-memory KV caches take: sent to every rank of the pool at an install."""
    machine: str
    reserved: int
    resident: int


def machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def usage() -> RankUsage:
    """This rank's ledger (models released but not yet collected are collected first: their memory goes too)."""
    gc.collect()
    reserved = resident = 0
    for cache in list(_held):
        for t in _tensors(cache):
            if not in_host_memory(t):
                continue
            n = t.numel() * t.element_size()
            reserved += n
            resident += resident_bytes(t.data_ptr(), n) or 0     # unknown: counted as not resident (less room)
    return RankUsage(machine_id(), reserved, resident)


@dataclass(frozen=True)
class MachineShare:
    """The budget the ranks of a pool on one machine share at an install."""
    ranks: int           # this pool's ranks on the machine
    available: int       # MemAvailable, read now
    reserved: int        # bytes the installed models' KV caches on the machine reserve
    resident: int        # ... of which in RAM

    @classmethod
    def of(cls, ranks: list[RankUsage], rank: int) -> "MachineShare":
        mine = [u for u in ranks if u.machine == ranks[rank].machine]
        return cls(len(mine), psutil.virtual_memory().available, sum(u.reserved for u in mine),
                   sum(u.resident for u in mine))

    @property
    def base(self) -> int:
        return self.available + self.resident

    @property
    def room(self) -> int:
        return max(0, int(NODE_KV_FRACTION * self.base) - self.reserved)

    def explain(self) -> str:
        return (f"{NODE_KV_FRACTION:.0%} of the {_size(self.base)} available for KV caches on this machine "
                f"({_size(self.available)} MemAvailable + {_size(self.resident)} of KV pages in use) is "
                f"{_size(NODE_KV_FRACTION * self.base)}, of which the models already installed hold "
                f"{_size(self.reserved)}: {_size(self.room)} left for {self.ranks} rank(s)")


def host_spans(cfg, span_bytes: int, share: MachineShare) -> int:
    """The spans of a host-memory KV cache for `cfg` on one rank; ValueError with the numbers where it does not
    fit the machine's budget."""
    if cfg.kv_cache_memory_bytes:
        need = cfg.kv_cache_memory_bytes * share.ranks
        if need > share.room:
            raise ValueError(f"kv_cache_memory_bytes {_size(cfg.kv_cache_memory_bytes)} per rank x "
                             f"{share.ranks} rank(s) on this machine = {_size(need)} does not fit: "
                             f"{share.explain()}")
        n = cfg.kv_cache_memory_bytes // span_bytes
        if n < 1:
            raise ValueError(f"kv cache budget {cfg.kv_cache_memory_bytes} bytes is smaller than one span "
                             f"({span_bytes} bytes)")
        return n
    spans_per_request = -(-cfg.engine_max_length // cfg.cache_span_size)
    cap = min(int(AUTO_KV_MAX_FRACTION * share.base), share.room) // share.ranks // span_bytes
    if cap < spans_per_request:
        raise ValueError(f"the KV cache cannot hold one request of max_length {cfg.engine_max_length} "
                         f"({_size(spans_per_request * span_bytes)} per rank): {share.explain()}; lower "
                         f"max_length, release a model, or free memory")
    return min(spans_per_request * cfg.engine_max_batch, cap)
