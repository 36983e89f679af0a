"""runner/hugepages.py: weights and KV pages moved into one huge-page arena keep their values, and the
arena really is advised MADV_HUGEPAGE (the kernel's VmFlags say so)."""
from __future__ import annotations

import mmap

import torch

from allspark_server.step.hugepages import to_hugepages, zeros


def smaps_line(t: torch.Tensor, key: str) -> list[str]:
    """The `key:` line's fields in /proc/self/smaps for the mapping that holds t's first byte."""
    addr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == key + ":":
                return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def vma_flags(t: torch.Tensor) -> set[str]:
    """VmFlags of the mapping that holds t's first byte."""
    return set(smaps_line(t, "VmFlags"))


def test_values_shapes_dtypes_survive_and_originals_are_released():
    gen = torch.Generator().manual_seed(0)
    source = {"w": torch.randn(1000, 1537, generator=gen).to(torch.bfloat16),   # odd sizes: offsets get aligned
              "b": torch.randn(7, generator=gen),
              "ids": torch.arange(5),
              "mask": torch.tensor([True, False, True]),
              "scalar": torch.tensor(3.5, dtype=torch.float64),
              "empty": torch.empty(0, 4),
              "strided": torch.randn(8, 6, generator=gen).t()}                    # not contiguous
    expected = {k: v.clone() for k, v in source.items()}
    moved = to_hugepages(source)
    assert source == {}                                       # handed over one by one
    assert list(moved) == list(expected)
    for name, want in expected.items():
        got = moved[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got, want), name
        assert got.data_ptr() % 4096 == 0 or got.numel() == 0, name
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in vma_flags(moved["w"])                  # advised: the kernel may back it with 2 MiB pages
    moved["w"][0, 0] = 1.0                                    # writable, and views of one arena do not overlap
    assert torch.equal(moved["b"], expected["b"])


def test_zeros_are_zero_and_independent():
    pages = zeros({"k0": ((3, 16, 2, 8), torch.bfloat16), "v0": ((3, 16, 2, 8), torch.bfloat16)})
    assert all(t.abs().sum() == 0 and t.shape == (3, 16, 2, 8) for t in pages.values())
    pages["k0"].fill_(1)
    assert pages["v0"].abs().sum() == 0


def test_without_huge_pages_plain_tensors(monkeypatch):
    import allspark_server.step.hugepages as hp
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    moved = hp.to_hugepages({"w": torch.ones(3, 4)})
    assert torch.equal(moved["w"], torch.ones(3, 4))
    # an ordinary torch allocation of its own, not a view of a page-aligned arena (the flags of the mapping that holds
    # it say nothing here: a small tensor shares malloc's heap with whatever else the process advised)
    assert moved["w"].untyped_storage().nbytes() == 3 * 4 * 4


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding t that are in RAM now (its Rss line)."""
    return int(smaps_line(t, "Rss")[0]) * 1024


def test_the_kv_cache_is_written_at_install_unless_prefault_is_off(monkeypatch):
    """ALLSPARK_KV_PREFAULT: on (the default) every page of a CPU rank's cache is in RAM once it is built; off, none
    is until a span is written, and what is read is zero either way."""
    from allspark_client import settings
    from allspark_server.step.kv_cache import KVCache
    size = 64 << 20
    resident = {}
    for value in ("1", "0"):
        monkeypatch.setenv("ALLSPARK_KV_PREFAULT", value)
        settings.reload()
        cache = KVCache(1, size // (16 * 2 * 64 * 4), 16, 2, 64, torch.float32)
        resident[value] = resident_bytes(cache.layers[0].k)
        assert cache.layers[0].v[-1].abs().sum().item() == 0
    monkeypatch.delenv("ALLSPARK_KV_PREFAULT")
    settings.reload()
    assert resident["1"] >= size, resident
    assert resident["0"] <= size // 8, resident
