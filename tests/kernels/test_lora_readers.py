"""LoRA deltas left to the kernel that reads the projection's output next (compute/pending_delta.py): grouped rows'
fp32 deltas added by the residual add + RMSNorm, silu·mul, gelu·mul or a plain add, and a GEMV's decode rows' expand
in the norm's own launch, each giving the bits of the expand into y followed by that kernel. On a CUDA machine on
the GPU (and replayed in a CUDA graph); elsewhere on CPU tensors under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch
from test_lora_dense import slots_of
from test_triton_fused import DEVICE, assert_same_bits, rows_view
from test_triton_lora import DTYPE_IDS, DTYPES, adapters, assert_within_bound, reference, slot_tensor

from allspark_server.compute import row_mode
from allspark_server.compute.cuda import cuda_ops
from allspark_server.compute.cuda import fused_kernels as fused
from allspark_server.compute.cuda import gemv_kernels as gk
from allspark_server.compute.cuda import lora_kernels as lk
from allspark_server.compute.lora_slots import LoraRows
from allspark_server.compute.pending_delta import PendingDelta


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_deltas_added_by_the_next_kernel_give_the_same_bits(dtype, poisoned_empty):
    # grouped rows with the expand beside the GEMM too (cuda_ops' o, gate|up and down projections): the fp32 deltas,
    # zeros for rows without an adapter, then added by whatever reads the output next (the residual add + RMSNorm,
    # silu·mul, gelu·mul, or the plain add) give the bits of the expand into y followed by that kernel
    slots, k, n, rank = [1, -1, 0, 1, 2, 0, -1], 96, 130, 16
    x = rows_view(len(slots), k, dtype, seed=30)
    gen = torch.Generator().manual_seed(31)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    a_stack, b_stack, unpadded = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=32)
    ids = slot_tensor(slots)
    residual = torch.randn(len(slots), n, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    gate_up = n - n % 2

    def plain():
        return lk.grouped_lora_linear(x, a_stack, b_stack, ids, lambda: torch.nn.functional.linear(x, w))

    def deferred():
        out = lk.grouped_lora_linear(x, a_stack, b_stack, ids, lambda: torch.nn.functional.linear(x, w), defer=True)
        assert isinstance(out, PendingDelta) and out.delta.dtype == torch.float32
        return out

    want = plain()
    pending = deferred()
    for row, s in enumerate(slots):
        if s < 0:
            assert not pending.delta[row].any(), "a row without an adapter got a delta"
    ref, bound = reference(torch.nn.functional.linear(x, w), x, unpadded, slots)
    assert_within_bound(pending.y.double() + pending.delta.double().cpu().to(pending.y.device), ref, 2 * bound)
    normed, stream = fused.rms_norm(want, weight, 1e-5, residual)
    got_normed, got_stream = pending.norm(weight, 1e-5, residual)
    assert_same_bits(got_stream, stream)
    assert_same_bits(got_normed, normed)
    for act in (fused.silu_mul, fused.gelu_tanh_mul):
        assert_same_bits(act(pending.y[:, :gate_up], delta=pending.delta[:, :gate_up]), act(want[:, :gate_up]))
    assert_same_bits(pending.resolved(), want)
    if DEVICE != "cuda":
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = deferred()
        out = captured.norm(weight, 1e-5, residual)[0]
    x.copy_(torch.randn_like(x))
    ids.copy_(slot_tensor([2, 0, -1, 1, 1, 0, 2]))
    graph.replay()
    assert_same_bits(out, fused.rms_norm(plain(), weight, 1e-5, residual)[0])


@pytest.mark.parametrize("rank", [16, 192], ids=["rank16", "rank192"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_expand_left_to_the_norm_gives_the_same_bits(dtype, rank, poisoned_empty):
    # a GEMV's decode rows of the o or down projection (cuda_ops.lora_linear's norm_reads): the shrink's partials
    # only, the expand in the launch of the residual add + RMSNorm that reads the output; the same bits as the
    # expand's own launch and then the norm (rank 192: three rank blocks; N = 130 and K = 300 off the tiles); in
    # the row modes the expand keeps its own launch
    k, n = 300, 130
    gen = torch.Generator().manual_seed(33)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    _, _, unpadded = adapters(2, [rank, 8], rank, k, n, dtype, seed=34)
    lora = slots_of(unpadded, k, n, spare=0)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    for slots in ([1, -1], [0]):
        x = rows_view(len(slots), k, dtype, seed=35 + len(slots))
        residual = torch.randn(len(slots), n, generator=gen).to(DEVICE, dtype)
        rows = LoraRows(slot_tensor(slots))
        want = cuda_ops.lora_linear(x, w, None, lora, rows)
        pending = cuda_ops.lora_linear(x, w, None, lora, rows, defer=True, norm_reads=True)
        assert isinstance(pending, PendingDelta) and isinstance(pending.delta, lk.Shrink)
        normed, stream = fused.rms_norm(want, weight, 1e-5, residual)
        got_normed, got_stream = pending.norm(weight, 1e-5, residual)
        assert_same_bits(got_stream, stream)
        assert_same_bits(got_normed, normed)
        assert_same_bits(pending.resolved(), want)
        ref, bound = reference(gk.gemv(x, w), x, unpadded, slots)
        assert_within_bound(want, ref, bound)
        with row_mode.alone_rows(True):
            assert not isinstance(cuda_ops.lora_linear(x, w, None, lora, rows, norm_reads=True), PendingDelta)
