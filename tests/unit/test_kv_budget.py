"""The KV budget of CPU ranks (allspark_server/runner/kv_budget.py), with no pool: the numbers of a machine's share
against hand-computed ones (explicit budgets refused when the machine's ranks together do not fit, automatic ones
split between its ranks and reduced by what installed models hold), and the ledger against memory this test wrote
(mincore's resident bytes) and tensors it made (reserved bytes)."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from allspark_server.runner import kv_budget
from allspark_server.runner.kv_budget import MachineShare, host_spans
from allspark_server.step import hugepages
from allspark_server.step.kv_cache import KVCache

GiB, MiB = 1 << 30, 1 << 20


def cfg(kv_bytes: int = 0, max_length: int = 1024, max_batch: int = 10**6, span: int = 16):
    return SimpleNamespace(kv_cache_memory_bytes=kv_bytes, engine_max_length=max_length, engine_max_batch=max_batch,
                           cache_span_size=span)


def test_explicit_budgets_must_fit_the_machine_with_its_other_ranks_and_models():
    # 10 GiB MemAvailable, installed models reserve 3 GiB of which 1 GiB is resident: 11 GiB for KV caches,
    # 0.9 x 11 = 9.9 GiB, 6.9 GiB left
    share = MachineShare(ranks=2, available=10 * GiB, reserved=3 * GiB, resident=1 * GiB)
    assert host_spans(cfg(3 * GiB), MiB, share) == 3 * 1024                     # 2 x 3 GiB = 6 GiB fits
    with pytest.raises(ValueError) as e:
        host_spans(cfg(int(3.5 * GiB)), MiB, share)                             # 2 x 3.5 GiB = 7 GiB does not
    message = str(e.value)
    for part in ("3.50 GiB per rank x 2 rank(s) on this machine = 7.00 GiB", "90% of the 11.00 GiB available",
                 "10.00 GiB MemAvailable + 1.00 GiB of KV pages in use", "is 9.90 GiB",
                 "the models already installed hold 3.00 GiB", "6.90 GiB left for 2 rank(s)"):
        assert part in message, (part, message)
    alone = MachineShare(ranks=1, available=10 * GiB, reserved=3 * GiB, resident=1 * GiB)
    assert host_spans(cfg(int(3.5 * GiB)), MiB, alone) == 3584                 # one rank: 3.5 GiB fits


def test_automatic_budgets_are_split_between_the_ranks_and_shrink_with_installed_models():
    idle = MachineShare(ranks=1, available=10 * GiB, reserved=0, resident=0)
    two = MachineShare(ranks=2, available=10 * GiB, reserved=0, resident=0)
    assert host_spans(cfg(), MiB, idle) == int(0.4 * 10 * GiB) // MiB           # 40% of the machine
    assert host_spans(cfg(), MiB, two) == int(0.4 * 10 * GiB) // 2 // MiB       # ... shared by its two ranks
    assert host_spans(cfg(max_batch=3), MiB, two) == 3 * 64                     # what max_batch x max_length asks
    late = MachineShare(ranks=2, available=10 * GiB, reserved=8 * GiB, resident=0)
    assert host_spans(cfg(), MiB, late) == int(0.9 * 10 * GiB - 8 * GiB) // 2 // MiB    # only what is left
    full = MachineShare(ranks=2, available=10 * GiB, reserved=9 * GiB, resident=0)
    with pytest.raises(ValueError, match=r"cannot hold one request of max_length 1024 \(64\.0 MiB per rank\): "
                                         r"90% of the 10\.00 GiB .* 0\.0 MiB left for 2 rank\(s\)"):
        host_spans(cfg(), MiB, full)


def test_resident_bytes_are_the_pages_written():
    arena = hugepages.zeros({"a": ((64 * MiB,), torch.uint8)})["a"]
    before = kv_budget.resident_bytes(arena.data_ptr(), arena.numel())
    assert before is not None and before <= 2 * MiB             # fresh anonymous memory: (almost) nothing in RAM
    arena[:16 * MiB].fill_(1)
    written = kv_budget.resident_bytes(arena.data_ptr(), arena.numel())
    assert 16 * MiB <= written <= 16 * MiB + 4 * MiB, written / MiB          # a huge page either side at most


def test_the_ledger_counts_held_caches_until_they_are_freed():
    base = kv_budget.usage().reserved
    cache = KVCache(num_layers=3, num_spans=40, span_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    kv_budget.hold(cache)
    assert kv_budget.usage().reserved - base == 3 * 2 * (40 * 16 * 2 * 8 * 2)  # layers x (K, V) x bytes of each
    del cache
    gc.collect()
    assert kv_budget.usage().reserved == base
