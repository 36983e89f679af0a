"""Eager steps' multi-adapter LoRA (allspark_server/compute/cuda/lora_dense.py: every slot's shrink as one GEMM,
masked to each row's own slot, and one addmm) against float64 torch, row by row, within the error bound of the
grouped kernels' tests (one rounding of the shrink's result, fp32 sums, one rounding of y); rows without an adapter
keep their values, whatever another slot's product does (NaN in their x, an overflow in another adapter); the
slots' side-by-side B follows loads and unloads. On the GPU where there is one (cuBLAS), else on CPU tensors."""
from __future__ import annotations

import pytest
import torch
from test_triton_fused import DEVICE, assert_same_bits, rows_view
from test_triton_lora import CASES, DTYPE_IDS, DTYPES, adapters, assert_within_bound, reference

from allspark_server.compute.cuda.lora_dense import dense_lora_add_
from allspark_server.compute.lora_slots import LoraRows, LoraSlots


def slots_of(unpadded, k: int, n: int, spare: int = 1) -> LoraSlots:
    """A projection's LoraSlots holding `unpadded`'s adapters in slots 0.., `spare` empty slots after them."""
    lora = LoraSlots(len(unpadded) + spare, max(a.shape[0] for a, _ in unpadded), k, n)
    for s, (a, b) in enumerate(unpadded):
        lora.set(s, a.to(DEVICE), b.to(DEVICE))
    return lora


def rows_of(slots) -> LoraRows:
    return LoraRows(torch.tensor(slots, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("slots,k,n,rank,count", CASES)
def test_dense_lora_against_float64(dtype, slots, k, n, rank, count):
    # the adapters' ranks differ (the stack pads the smaller with zeros); an empty slot follows them
    ranks = [rank if s % 2 == 0 else max(1, rank // 2) for s in range(count)]
    _, _, unpadded = adapters(count, ranks, rank, k, n, dtype, seed=rank)
    x = rows_view(len(slots), k, dtype, seed=k)                                             # [T, K] strided
    y = torch.randn(len(slots), n, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    before = y.clone()
    assert dense_lora_add_(y, x, slots_of(unpadded, k, n), rows_of(slots)) is y
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    skipped = [row for row, s in enumerate(slots) if s < 0]
    assert_same_bits(y[skipped], before[skipped])


def test_other_slots_products_never_reach_a_row():
    # float16: adapter 0's A overflows on every row (x @ A0 = inf); rows of adapter 1 and of the base model, NaN x
    # on one of those, still come out as their own slot alone makes them
    dtype, k, n, rank, slots = torch.float16, 64, 40, 8, [1, -1, 1, -1]
    _, _, unpadded = adapters(2, [rank, rank], rank, k, n, dtype, seed=5)
    unpadded[0] = (torch.full((rank, k), 6e4, dtype=dtype), unpadded[0][1])
    x = rows_view(len(slots), k, dtype, seed=6).abs() + 1.0
    x[3] = float("nan")
    y = rows_view(len(slots), n, dtype, seed=7)
    before = y.clone()
    dense_lora_add_(y, x, slots_of(unpadded, k, n, spare=0), rows_of(slots))
    assert torch.isinf((x.double().cpu() @ unpadded[0][0].double().T).to(dtype))[[0, 2]].all(), "no overflow"
    ref, bound = reference(before[[0, 2]], x[[0, 2]], unpadded, [1, 1])
    assert_within_bound(y[[0, 2]], ref, bound)
    assert_same_bits(y[[1, 3]], before[[1, 3]])


def test_side_by_side_b_follows_loads_and_unloads():
    # the n-major copy of B is made again after a slot changes: a new adapter in slot 1, then slot 0 unloaded
    dtype, k, n, rank, slots = torch.float32, 48, 24, 4, [0, 1, 0, -1]
    _, _, first = adapters(2, [rank, rank], rank, k, n, dtype, seed=8)
    _, _, second = adapters(2, [rank, rank], rank, k, n, dtype, seed=9)
    lora = slots_of(first, k, n)
    x = rows_view(len(slots), k, dtype, seed=10)
    y = rows_view(len(slots), n, dtype, seed=11)
    for change in (None, lambda: lora.set(1, second[1][0].to(DEVICE), second[1][1].to(DEVICE)),
                   lambda: lora.clear(0)):
        if change is not None:
            change()
        now = [(lora.a[s].cpu(), lora.b[s].cpu()) if lora.a[s] is not None else None for s in range(2)]
        out = dense_lora_add_(y.clone(), x, lora, rows_of(slots))
        live = [row for row, s in enumerate(slots) if s >= 0 and now[s] is not None]
        ref, bound = reference(y[live], x[live], now, [slots[row] for row in live])
        assert_within_bound(out[live], ref, bound)
        dead = [row for row in range(len(slots)) if row not in live]
        assert_same_bits(out[dead], y[dead])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_steps_and_their_warm_ups_take_the_grouped_kernels(monkeypatch):
    # capture_each_size's warm-ups run eagerly but take the capture's path, so its Triton kernels compile and its
    # counters exist before the capture (K = 1024: the shrink splits K into chunks, which count one another); an
    # eager step takes lora_dense; both within the bound
    from allspark_server.compute.cuda import cuda_ops, graph_capture
    calls, dense = [], cuda_ops.dense_lora_add_
    monkeypatch.setattr(cuda_ops, "dense_lora_add_", lambda *a: calls.append(len(a[1])) or dense(*a))
    dtype, k, n, rank, slots = torch.bfloat16, 1024, 256, 16, [0, 1, -1, 0, 1, 1, -1, 0]
    _, _, unpadded = adapters(2, [rank, rank], rank, k, n, dtype, seed=12)
    lora, rows = slots_of(unpadded, k, n), rows_of(slots)
    x = rows_view(len(slots), k, dtype, seed=13).contiguous()
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(14)) / k ** 0.5).to(DEVICE, dtype)
    graphs, outs = graph_capture.capture_each_size(
        lambda b: cuda_ops.lora_linear(x[:b], w, None, lora, LoraRows(rows.slots[:b])), [len(slots)])
    assert calls == [], "a graph's warm-up or capture took the eager path"
    graphs[len(slots)].replay()
    eager = cuda_ops.lora_linear(x, w, None, lora, rows)
    assert calls == [len(slots)]
    ref, bound = reference(torch.nn.functional.linear(x, w), x, unpadded, slots)
    for out in (outs[len(slots)], eager):
        assert_within_bound(out, ref, bound)
