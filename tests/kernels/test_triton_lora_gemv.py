"""LoRA on the GEMV's decode rows: the shrink inside the GEMV's launch (gemv_kernels.gemv_shrink, lora_in_gemv.py),
the expand in one more (lora_kernels.expand_rows_, with the MLP's activation where asked). Checked against float64
torch row by row (test_triton_lora.py's reference and error bound), the projection bit for bit as the plain GEMV's,
rows without an adapter untouched, the activation bit for bit as ops.silu_mul / gelu_tanh_mul of the updated
projection, each row's shrink as it is alone (alone-rows mode too), and, on a GPU, replayed in a CUDA graph with new
slots and adapters. Without a GPU: CPU tensors under the Triton interpreter, small shapes."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # read when @triton.jit decorates: before the import
pytest.importorskip("triton")

from test_triton_fused import DEVICE, assert_same_bits, assert_within_ulps, rows_view  # noqa: E402
from test_triton_lora import adapters, assert_within_bound, reference, slot_tensor  # noqa: E402

from allspark_server.compute import row_mode  # noqa: E402
from allspark_server.compute.cuda import fused_kernels as fused  # noqa: E402
from allspark_server.compute.cuda import gemv_kernels as gk  # noqa: E402
from allspark_server.compute.cuda import lora_kernels as lk  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]        # what the GEMV takes
DTYPE_IDS = ["bfloat16", "float16"]
CASES = [  # (slots, K, N, R, adapters): K and N off the tiles; R = 48 a fused q|k|v of rank 16
    ([0], 64, 40, 8, 1), ([1, -1, 0], 96, 72, 16, 2), ([2, -1, 0, 2, 1], 72, 50, 48, 3),
]
SMALL = gk.GemvConfig(block_n=2, block_k=32, num_warps=4)    # several k-tiles (the last partial) at these K


def weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)


def shrink_reference(x, unpadded, slots, rank, dtype):
    """(t [M, R] in float64 for the rows with an adapter, zeros past each adapter's rank; the bound of one rounding
    to dtype after an fp32 sum of K terms)."""
    u, u32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps / 2
    t = torch.zeros(len(slots), rank, dtype=torch.float64)
    bound = torch.zeros_like(t)
    for row, s in enumerate(slots):
        if s >= 0:
            a = unpadded[s][0].double()
            xr = x[row].double().cpu()
            t[row, :a.shape[0]] = xr @ a.T
            sums = x.shape[1] * (xr.abs() @ a.abs().T)                  # the fp32 sum's bound over K terms
            bound[row, :a.shape[0]] = 1.01 * (u * (xr @ a.T).abs() + (1 + u) * u32 * sums)
    return t, bound


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("slots,k,n,rank,count", CASES)
def test_shrink_in_the_gemv_then_expand_against_float64(dtype, slots, k, n, rank, count, poisoned_empty):
    rows = len(slots)
    x = rows_view(rows, k, dtype, seed=k)
    w = weight(n, k, dtype, seed=n)
    a_stack, b_stack, unpadded = adapters(count, [rank] * count, rank, k, n, dtype, seed=rank)
    ids = slot_tensor(slots)
    plain = gk.gemv(x, w, config=SMALL)
    y, t = gk.gemv_shrink(x, w, None, a_stack, ids, config=SMALL)
    assert_same_bits(y, plain)                                   # the shrink's programs leave the projection as it was
    with_adapter = [row for row, s in enumerate(slots) if s >= 0]
    t_ref, t_bound = shrink_reference(x, unpadded, slots, rank, dtype)
    assert_within_bound(t[with_adapter], t_ref[with_adapter], t_bound[with_adapter])
    assert lk.expand_rows_(y, t, b_stack, ids) is y
    ref, bound = reference(plain, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    # against the shrink rounded where PEFT rounds it: the fp32 sums' order differs, so an element of t may round
    # to its neighbour, which moves y by that ulp of t times B: two ulps of y at most here, rarely
    ref_t, _ = reference(plain, x, unpadded, slots, round_t=True)
    assert_within_ulps(y, ref_t.to(dtype).to(DEVICE), 2, max_mismatch=0.05)
    skipped = [row for row, s in enumerate(slots) if s < 0]
    assert_same_bits(y[skipped], plain[skipped])


@pytest.mark.parametrize("act,fn", [("silu", fused.silu_mul), ("gelu_tanh", fused.gelu_tanh_mul)], ids=["silu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_expand_with_the_activation_equals_the_two_launches(act, fn, dtype, poisoned_empty):
    # gate|up [M, 2I], I = 36 (off the tiles): rows with an adapter get both halves' deltas, then act(gate) * up
    slots, k, inter, rank = [1, -1, 0, 1], 96, 36, 32
    x = rows_view(len(slots), k, dtype, seed=20)
    w = weight(2 * inter, k, dtype, seed=21)
    a_stack, b_stack, _ = adapters(2, [rank, 24], rank, k, 2 * inter, dtype, seed=22)
    ids = slot_tensor(slots, torch.int32)
    y, t = gk.gemv_shrink(x, w, None, a_stack, ids, config=SMALL)
    before = y.clone()
    a = lk.expand_rows_(y, t, b_stack, ids, act)
    assert a.shape == (len(slots), inter)
    assert_same_bits(y, before)                                  # the projection itself is not written
    assert_same_bits(a, fn(lk.expand_rows_(y.clone(), t, b_stack, ids)))
    assert_same_bits(a[1], fn(before[1:2])[0])                   # no adapter: the activation of the plain row


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone-rows"])
def test_each_rows_shrink_is_its_own(alone, poisoned_empty):
    # a row's t does not depend on the other rows, and in alone-rows mode (a verify chunk) neither does its output:
    # the same bits as the row's one-row launches
    dtype, slots, k, n, rank = torch.bfloat16, [2, 0, 2, -1, 1, 0], 80, 40, 16
    x = rows_view(len(slots), k, dtype, seed=30)
    w = weight(n, k, dtype, seed=31)
    a_stack, b_stack, _ = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=32)
    with row_mode.alone_rows(alone):
        y, t = gk.gemv_shrink(x, w, None, a_stack, slot_tensor(slots), config=SMALL)
        lk.expand_rows_(y, t, b_stack, slot_tensor(slots))
    for row, s in enumerate(slots):
        y1, t1 = gk.gemv_shrink(x[row:row + 1], w, None, a_stack, slot_tensor([s]), config=SMALL)
        lk.expand_rows_(y1, t1, b_stack, slot_tensor([s]))
        if s >= 0:
            assert_same_bits(t[row], t1[0])
        if alone:   # batched, the projection's rows follow the plain GEMV's own rule for M rows
            assert_same_bits(y[row], y1[0])


def test_bias_and_rejected_shapes():
    dtype, slots, k, n, rank = torch.bfloat16, [0, -1], 64, 48, 8
    x = rows_view(2, k, dtype, seed=40)
    w = weight(n, k, dtype, seed=41)
    bias = weight(1, n, dtype, seed=42)[0].contiguous()
    a_stack, b_stack, _ = adapters(1, [rank], rank, k, n, dtype, seed=43)
    y, _ = gk.gemv_shrink(x, w, bias, a_stack, slot_tensor(slots), config=SMALL)
    assert_same_bits(y, gk.gemv(x, w, bias, config=SMALL))
    with pytest.raises(AssertionError):
        gk.gemv_shrink(x, w, None, a_stack.float(), slot_tensor(slots))
    with pytest.raises(AssertionError):
        gk.gemv_shrink(x, w, None, a_stack[:, :, :32], slot_tensor(slots))
    y, t = gk.gemv_shrink(x, w, None, a_stack, slot_tensor(slots))
    with pytest.raises(AssertionError):
        lk.expand_rows_(y, t[:, :4], b_stack, slot_tensor(slots))
    with pytest.raises(AssertionError):
        lk.expand_rows_(y[:, :47], t, b_stack[:, :47], slot_tensor(slots), "silu")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("act", [None, "silu"], ids=["plain", "silu"])
def test_replays_in_a_cuda_graph_with_new_slots_and_adapters(act):
    dtype, k, n, rank = torch.bfloat16, 4096, 12288, 48
    x = rows_view(1, k, dtype, seed=50)
    w = weight(n, k, dtype, seed=51)
    a_stack, b_stack, _ = adapters(3, [rank] * 3, rank, k, n, dtype, seed=52)
    ids = slot_tensor([0])

    def run():
        y, t = gk.gemv_shrink(x, w, None, a_stack, ids)
        return lk.expand_rows_(y, t, b_stack, ids, act)
    run()                                                                   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new_a, new_b, unpadded = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=53)
    a_stack.copy_(new_a)
    b_stack.copy_(new_b)
    for s in (1, 2, -1):
        x.copy_(torch.randn_like(x))
        ids.copy_(slot_tensor([s]))
        graph.replay()
        assert_same_bits(out, run())                                        # eager: the same launches
        if act is None:
            ref, bound = reference(gk.gemv(x, w), x, unpadded, [s])
            assert_within_bound(out, ref, bound)
