"""Multi-adapter LoRA (allspark_server/compute/cuda/lora_kernels.py) against float64 torch, row by row:
y += (x @ A[s].T) @ B[s].T for the rows with an adapter, within the error bound of one rounding of the shrink's
result to the activation dtype and one of y (plus fp32 sums), and as close as that to a reference that rounds the
shrink's result exactly where PEFT does; rows without an adapter (slot -1) bit for bit as they were, NaN and all;
several adapters in a batch, int32 and int64 slots, a column slice of a wider output, ranks padded with zeros,
tiles small enough that every loop and mask runs. On a CUDA machine on the GPU (and replayed in a CUDA graph);
elsewhere on CPU tensors under the Triton interpreter (small shapes)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import DEVICE, assert_same_bits, assert_within_ulps, rows_view

from allspark_server.compute import row_mode
from allspark_server.compute.cuda import gemv_kernels as gk
from allspark_server.compute.cuda import lora_grouped as lg
from allspark_server.compute.cuda import lora_kernels as lk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]
CASES = [  # (slots, K, N, R, adapters): K and N off the power-of-two tiles; R = 192 is a fused q|k|v of rank 64
    ([0], 64, 40, 8, 1), ([1, -1, 0], 96, 200, 16, 2), ([2, -1, 0, 2, 3, -1, 1], 72, 130, 48, 4),
    ([1, 0, -1], 64, 48, 192, 2),
]


def adapters(count: int, ranks: list[int], rank: int, k: int, n: int, dtype: torch.dtype, seed: int):
    """(a_stack [S, R, K], b_stack [S, N, R], the unpadded [(A [r, K], B [N, r])]): adapter s of rank ranks[s],
    zeros past it; B scaled so that the update is about the size of y."""
    gen = torch.Generator().manual_seed(seed)
    a_stack = torch.zeros(count, rank, k, dtype=dtype)
    b_stack = torch.zeros(count, n, rank, dtype=dtype)
    for s, r in enumerate(ranks):
        a_stack[s, :r] = torch.randn(r, k, generator=gen) / k ** 0.5
        b_stack[s, :, :r] = torch.randn(n, r, generator=gen) / r ** 0.5
    unpadded = [(a_stack[s, :r].clone(), b_stack[s, :, :r].clone()) for s, r in enumerate(ranks)]
    return a_stack.to(DEVICE), b_stack.to(DEVICE), unpadded


def reference(y, x, unpadded, slots, round_t: bool = False):
    """(y + (x @ A.T) @ B.T in float64 row by row, the error bound of the kernel's one rounding of the shrink to
    the dtype, fp32 sums and one rounding of y); round_t: the shrink's result rounded to the dtype first."""
    u = torch.finfo(y.dtype).eps / 2                                            # unit roundoff
    u32 = torch.finfo(torch.float32).eps / 2
    out, bound = y.double().cpu().clone(), torch.zeros(y.shape, dtype=torch.float64)
    for row, s in enumerate(slots):
        if s < 0:
            continue
        a, b = (m.double() for m in unpadded[s])
        xr = x[row].double().cpu()
        t = xr @ a.T                                                             # [r]
        if round_t:
            t = t.to(y.dtype).double()
        out[row] += t @ b.T
        # |t rounding| <= u |t|; fp32 sums of K and of r terms; y's rounding <= u |y|
        tb = t.abs() @ b.abs().T
        xab = (xr.abs() @ a.abs().T) @ b.abs().T
        bound[row] = u * tb + u32 * (a.shape[1] * xab + b.shape[1] * tb)
    bound = 1.01 * (u * (out.abs() + bound) + bound)
    return out, bound


def assert_within_bound(y, ref, bound):
    assert torch.isfinite(y).all(), "non-finite output"
    err = (y.double().cpu() - ref).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"{worst:.2f}x the error bound"


def slot_tensor(slots, dtype=torch.int64):
    return torch.tensor(slots, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("grouped", [False, True], ids=["a-row-a-program", "grouped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("slots,k,n,rank,count", CASES)
def test_lora_add_against_float64(dtype, slots, k, n, rank, count, grouped, poisoned_empty):
    rows = len(slots)
    x = rows_view(rows, k, dtype, seed=k)                                                   # [T, K] strided
    y = rows_view(rows, n, dtype, seed=n)                                                   # [T, N] strided
    a_stack, b_stack, unpadded = adapters(count, [rank] * count, rank, k, n, dtype, seed=rank)
    before = y.clone()
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor(slots), grouped=grouped)
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    if dtype != torch.float32:
        # against the shrink rounded where PEFT rounds it: only the order of the fp32 sums differs, so the two
        # roundings land on a neighbour at most, rarely
        ref_t, _ = reference(before, x, unpadded, slots, round_t=True)
        assert_within_ulps(y, ref_t.to(dtype).to(DEVICE), 1, max_mismatch=0.05)
    skipped = [row for row, s in enumerate(slots) if s < 0]
    assert_same_bits(y[skipped], before[skipped])


@pytest.mark.parametrize("grouped", [False, True], ids=["a-row-a-program", "grouped"])
@pytest.mark.parametrize("rank", [16, 192], ids=["rank16", "rank192"])
def test_each_row_as_alone_in_any_batch(rank, grouped, poisoned_empty):
    # each of seven rows comes out bit for bit as when it is the only row: a program a row, or grouped by adapter
    # on tensor cores (192: three rank blocks, each with its own counter of the shrink's last program)
    dtype, slots, k, n = torch.bfloat16, [1, -1, 0, 2, 2, 0, 1], 200, 72
    x = rows_view(len(slots), k, dtype, seed=41)
    y = rows_view(len(slots), n, dtype, seed=42)
    a_stack, b_stack, _ = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=43)
    ids = slot_tensor(slots)
    batched = y.clone()
    lk.lora_add_(batched, x, a_stack, b_stack, ids, grouped=grouped)
    for t in range(len(slots)):
        alone = y[t:t + 1].clone()
        lk.lora_add_(alone, x[t:t + 1], a_stack, b_stack, ids[t:t + 1], grouped=grouped)
        assert_same_bits(batched[t:t + 1], alone)
    assert not lg.counters(x.device, 1).any(), "the shrink's counters are left at zero for the next launch"


def test_grouped_expand_over_several_blocks_of_rows(poisoned_empty):
    # 150 rows: three blocks of 64 rows a program (the last partial), rows of one adapter in every block; K = 600:
    # two chunks of the shrink, the last partial; each row within the bound of float64, and a row alone bit-equal
    # to itself in the batch
    dtype, k, n, rank = torch.bfloat16, 600, 40, 16
    slots = [(i % 4) - 1 for i in range(150)]                                  # -1, 0, 1, 2 in turn
    x = rows_view(len(slots), k, dtype, seed=46)
    y = rows_view(len(slots), n, dtype, seed=47)
    a_stack, b_stack, unpadded = adapters(3, [rank] * 3, rank, k, n, dtype, seed=48)
    ids = slot_tensor(slots)
    before = y.clone()
    lk.lora_add_(y, x, a_stack, b_stack, ids, grouped=True)
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    for t in (0, 1, 130, 149):
        alone = before[t:t + 1].clone()
        lk.lora_add_(alone, x[t:t + 1], a_stack, b_stack, ids[t:t + 1], grouped=True)
        assert_same_bits(y[t:t + 1], alone)


def test_grouped_shrink_rounds_each_rows_sum_once(poisoned_empty):
    # the grouped shrink's t: each row's x @ A[slot].T summed in fp32 over the chunks (K = 1100: three chunks, the
    # last partial) and rounded to the dtype once, by the last chunk program: within an ulp of the float64 sum
    # rounded; rows without a slot untouched
    dtype, slots, k, rank = torch.bfloat16, [0, 1, -1, 1], 1100, 16
    x = rows_view(len(slots), k, dtype, seed=44)
    a_stack, _, unpadded = adapters(2, [rank, rank], rank, k, 8, dtype, seed=45)
    t = torch.full((len(slots), rank), float("nan"), dtype=dtype, device=x.device)
    lg.shrink_(x, a_stack, slot_tensor(slots), t)
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.isnan(t[row]).all()
            continue
        want = (x[row].double().cpu() @ unpadded[slot][0].double().T).to(dtype)
        assert_within_ulps(t[row], want.to(DEVICE), 1, max_mismatch=0.1)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_rows_without_an_adapter_keep_their_bits(slot_dtype, poisoned_empty):
    # NaN in x and y on the skipped rows: a kernel that reads x or writes y there shows
    dtype, slots, k, n, rank = torch.bfloat16, [-1, 1, -1, -1, 0], 80, 70, 16
    x = rows_view(len(slots), k, dtype, seed=1)
    y = rows_view(len(slots), n, dtype, seed=2)
    skipped = [row for row, s in enumerate(slots) if s < 0]
    x[skipped] = float("nan")
    y[skipped[0]] = float("nan")
    a_stack, b_stack, unpadded = adapters(2, [rank, rank], rank, k, n, dtype, seed=3)
    before = y.clone()
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor(slots, slot_dtype))
    assert_same_bits(y[skipped], before[skipped])
    ref, bound = reference(before[[1, 4]], x[[1, 4]], unpadded, [1, 0])
    assert_within_bound(y[[1, 4]], ref, bound)
    # no row with an adapter: nothing changes at all
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor([-1] * len(slots), slot_dtype))
    assert_same_bits(y[skipped], before[skipped])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_column_slice_of_a_wider_output(dtype, poisoned_empty):
    # y is q's columns of a fused [T, q | k | v] output: only that slice of the rows with an adapter changes
    slots, k, n, rank = [0, -1, 2, 1], 96, 120, 16
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(len(slots), n + 56, generator=gen).to(DEVICE, dtype)
    y = wide[:, 24:24 + n]
    x = rows_view(len(slots), k, dtype, seed=5)
    a_stack, b_stack, unpadded = adapters(3, [rank] * 3, rank, k, n, dtype, seed=6)
    before = wide.clone()
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor(slots))
    assert_same_bits(wide[:, :24], before[:, :24])
    assert_same_bits(wide[:, 24 + n:], before[:, 24 + n:])
    assert_same_bits(wide[1], before[1])
    ref, bound = reference(before[:, 24:24 + n], x, unpadded, slots)
    assert_within_bound(y, ref, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixed_ranks_padded_with_zeros(dtype, poisoned_empty):
    # adapters of rank 4, 16 and 9 in one R = 16 stack, against their unpadded matrices
    slots, k, n = [2, 0, 1, -1, 2, 0, 1], 64, 96
    x = rows_view(len(slots), k, dtype, seed=7)
    y = rows_view(len(slots), n, dtype, seed=8)
    a_stack, b_stack, unpadded = adapters(3, [4, 16, 9], 16, k, n, dtype, seed=9)
    before = y.clone()
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor(slots, torch.int32))
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    assert_same_bits(y[3], before[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_small_tiles_run_every_loop_and_mask(dtype, monkeypatch, poisoned_empty):
    # 16-wide rank blocks and 256-element tiles: R = 48 is three shrink programs a row and three expand steps,
    # K = 72 five k-tiles (the last partial) in three 32-column chunks (the last partial), N = 130 nine n-blocks
    # (the last partial); ranks 40 and 48 mixed
    monkeypatch.setattr(lk, "MAX_BLOCK_R", 16)
    monkeypatch.setattr(lk, "TILE", 256)
    monkeypatch.setattr(lk, "K_CHUNK", 32)
    assert lk.blocks(48, 72, 130) == (16, 16, 16)
    slots, k, n = [1, -1, 0], 72, 130
    x = rows_view(len(slots), k, dtype, seed=10)
    y = rows_view(len(slots), n, dtype, seed=11)
    a_stack, b_stack, unpadded = adapters(2, [48, 40], 48, k, n, dtype, seed=12)
    before = y.clone()
    lk.lora_add_(y, x, a_stack, b_stack, slot_tensor(slots))
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    assert_same_bits(y[1], before[1])


def test_empty_batch():
    y, x = torch.empty(0, 40, device=DEVICE), torch.empty(0, 64, device=DEVICE)
    a_stack, b_stack = torch.zeros(2, 8, 64, device=DEVICE), torch.zeros(2, 40, 8, device=DEVICE)
    lk.lora_add_(y, x, a_stack, b_stack, torch.empty(0, dtype=torch.int64, device=DEVICE))


def test_rejects_mismatched_shapes_and_dtypes():
    x, y = torch.zeros(2, 64, device=DEVICE), torch.zeros(2, 40, device=DEVICE)
    a_stack, b_stack = torch.zeros(2, 8, 64, device=DEVICE), torch.zeros(2, 40, 8, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError):
        lk.lora_add_(y, x, a_stack, b_stack[:, :, :4], slots)
    with pytest.raises(AssertionError):
        lk.lora_add_(y, x, a_stack.bfloat16(), b_stack, slots)
    with pytest.raises(AssertionError):
        lk.lora_add_(y, x, a_stack, b_stack, slots.float())
    with pytest.raises(AssertionError):
        lk.lora_add_(y.T.contiguous().T, x, a_stack, b_stack, slots)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_replays_in_a_cuda_graph_with_new_slots_and_adapters():
    dtype, slots, k, n, rank = torch.bfloat16, [0, -1, 1, 0], 512, 384, 48
    x = rows_view(len(slots), k, dtype, seed=13)
    y = rows_view(len(slots), n, dtype, seed=14)
    a_stack, b_stack, _ = adapters(3, [rank] * 3, rank, k, n, dtype, seed=15)
    slot_ids = slot_tensor(slots)
    lk.lora_add_(y, x, a_stack, b_stack, slot_ids)                          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.lora_add_(y, x, a_stack, b_stack, slot_ids)
    new_a, new_b, unpadded = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=16)
    a_stack.copy_(new_a)
    b_stack.copy_(new_b)
    x.copy_(torch.randn_like(x))
    slots = [2, 1, -1, 0]
    slot_ids.copy_(slot_tensor(slots))
    before = y.clone()
    graph.replay()
    ref, bound = reference(before, x, unpadded, slots)
    assert_within_bound(y, ref, bound)
    assert_same_bits(y[2], before[2])


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_shrink_inside_the_gemv_launch_gives_the_same_bits(dtype, alone, poisoned_empty):
    # the decode GEMV carrying the shrink's programs (cuda_ops.lora_linear), then the expand in a launch of its own:
    # the same bits as the plain GEMV followed by lora_add_'s two launches; K = 300 is two chunks of 256, the last
    # partial
    slots, k, n, rank = [1, -1, 0], 300, 72, 16
    x = rows_view(len(slots), k, dtype, seed=17)
    gen = torch.Generator().manual_seed(18)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    a_stack, b_stack, unpadded = adapters(2, [rank, 8], rank, k, n, dtype, seed=19)
    ids = slot_tensor(slots)
    with row_mode.alone_rows(alone):
        want = gk.gemv(x, w)
        plain = want.clone()
        lk.lora_add_(want, x, a_stack, b_stack, ids)
        shrink = lk.Shrink.of(x, a_stack, b_stack, ids)
        assert shrink.splits == 2 and shrink.programs == len(slots) * 2
        y = gk.gemv(x, w, lora=shrink)
    assert_same_bits(y, want)
    ref, bound = reference(plain, x, unpadded, slots)
    assert_within_bound(y, ref, bound)


def test_counters_grow_and_keep_the_old_buffers(poisoned_empty):
    # a prefill of more rows than the counters cover makes a larger buffer; the old one stays (graphs use it)
    from allspark_server.compute.cuda import stream_counters
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    small = lg.counters(device, 8)
    big = lg.counters(device, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    buffers = [b for (use, dev, _), bufs in stream_counters._BUFFERS.items() if use == "lora" for b in bufs]
    assert any(b is small for b in buffers) and any(b is big for b in buffers)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_shrink_beside_the_linear_gives_the_same_bits(dtype, poisoned_empty):
    # grouped rows (cuda_ops.lora_linear): the shrink on a side stream while the projection's GEMM runs, then the
    # expand: the same bits as the GEMM followed by lora_add_'s grouped launches; on a GPU also from a CUDA graph
    # (a fork and a join) replayed with new inputs and slots
    slots, k, n, rank = [1, -1, 0, 1, 2, 0], 96, 130, 16
    x = rows_view(len(slots), k, dtype, seed=20)
    gen = torch.Generator().manual_seed(21)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    a_stack, b_stack, unpadded = adapters(3, [rank, 8, rank], rank, k, n, dtype, seed=22)
    ids = slot_tensor(slots)

    def want():
        y = torch.nn.functional.linear(x, w)
        lk.lora_add_(y, x, a_stack, b_stack, ids, grouped=True)
        return y

    def got():
        return lk.grouped_lora_linear(x, a_stack, b_stack, ids, lambda: torch.nn.functional.linear(x, w))

    assert_same_bits(got(), want())
    ref, bound = reference(torch.nn.functional.linear(x, w), x, unpadded, slots)
    assert_within_bound(got(), ref, bound)
    if DEVICE != "cuda":
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = got()
    x.copy_(torch.randn_like(x))
    ids.copy_(slot_tensor([2, 0, -1, 1, 1, 0]))
    graph.replay()
    assert_same_bits(out, want())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_deltas_added_by_the_next_kernel_give_the_same_bits(dtype, poisoned_empty):
    # grouped rows with the expand beside the GEMM too (cuda_ops' o, gate|up and down projections): the fp32 deltas,
    # zeros for rows without an adapter, then added by whatever reads the output next (the residual add + RMSNorm,
    # silu·mul, gelu·mul, or the plain add) give the bits of the expand into y followed by that kernel
    from allspark_server.compute.cuda import fused_kernels as fused
    from allspark_server.compute.pending_delta import PendingDelta
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
