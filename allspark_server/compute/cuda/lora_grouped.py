"""Multi-adapter LoRA for batches of many rows (lora_kernels.lora_add_'s `grouped`): the rows of each adapter slot
taken together on tensor cores, so each tile of A and B is read once per slot and block of rows, not once a row,
and the programs a launch makes do not grow with the rows.

    shrink  grid (S, cdiv(R, BLOCK_R), splits x row blocks): program (slot s, r-block, k-chunk, rows) takes the
            block's rows t with slots[t] == s (none: nothing but the wait) and writes the chunk's fp32 partial
            x[t, chunk] @ A[s, r, chunk].T into part [T, splits, R] (tensor-core products); the last of a (slot,
            r-block, rows)'s chunk programs to finish (a counter, left at zero again) sums every chunk's partial in
            chunk order and writes t [T, R] rounded to x's dtype (PEFT's lora_A(x) in the module dtype)
    expand  grid (S, cdiv(N, BLOCK_N), row blocks): program (slot s, n-block, rows): y[t, n] = round(y[t, n] +
            sum_r B[s, n, r] t[t, r]) for those rows, one tensor-core product of s's tile of B and their t

A row's sums never depend on the other rows (an MMA's output element sums its own row or column, the chunks and
k-tiles come in a fixed order), so a row comes out the same in any batch; its bits differ from the expand a row a
program takes (lora_kernels), which decode rows of the GEMV use. Both launches keep pdl.py's contract (slots, and
the expand's first tile of B, are read before the wait).

In a CUDA graph `grouped_lora_linear` runs the shrink on a side stream beside the projection's GEMM
(side_stream.py): it needs only x. A shrink of a program per row and chunk, as lora_kernels' is, fills the GPU and
runs after the GEMM however it is launched; this one's few programs (S x SPLITS a block of rows) fit beside it
(benchmarks/lora_kernels_micro.py's "beside"). Deferred (cuda_ops' decode steps), the expand follows the shrink
there, into fp32 deltas that the kernel reading the projection's output adds (compute/pending_delta.py), so no
LoRA launch waits for the GEMM (the micro's "deferred").
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.fused_kernels import _round
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous
from allspark_server.compute.cuda.side_stream import beside, join
from allspark_server.compute.cuda.stream_counters import stream_counters

COUNTERS = 1 << 12   # counters made at a time: one a (slot, r-block, block of rows)
# k-chunks a shrink splits K into: a slot's rows are a program per chunk (a program streaming all of K alone is
# latency-bound), whose partials the last one sums in chunk order; the chunk comes from K and SPLITS alone
SPLITS = 8
NUM_STAGES = 3       # the shrink's k-loop, pipelined
BLOCK_K = 128        # the shrink's k-tile
BLOCK_N = 128        # outputs an expand program takes
MAX_BLOCK_T = 64     # rows a program takes at most
MAX_BLOCK_R = 64     # rank columns a program holds
NUM_WARPS = 4


@triton.jit(do_not_specialize=["T"])    # the rows: one compiled kernel for any batch
def _grouped_shrink_kernel(x, a, slots, part, t, counters, T, K, R, CHUNK, stride_xt, stride_as, stride_ar,
                           stride_pt, stride_ps, stride_tt, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                           SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (slot s, r-block, chunk + SPLITS * row block): see the module's docstring."""
    allow_next(PDL)
    s, r_block = tl.program_id(0), tl.program_id(1)
    chunk, row_block = tl.program_id(2) % SPLITS, tl.program_id(2) // SPLITS
    offs_t = row_block * BLOCK_T + tl.arange(0, BLOCK_T)
    mine = tl.load(slots + offs_t, mask=offs_t < T, other=-1) == s                        # [BT]
    any_row = tl.max(mine.to(tl.int32), 0) > 0
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    cols_a = a + s.to(tl.int64) * stride_as + offs_r.to(tl.int64)[None, :] * stride_ar  # [1, BR]
    k_end = tl.minimum(K, (chunk + 1) * CHUNK)
    wait_for_previous(PDL)          # every program waits: this kernel completes only after the one before
    if any_row:
        rows_x = x + offs_t.to(tl.int64)[:, None] * stride_xt                           # [BT, 1]
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(chunk * CHUNK, k_end, BLOCK_K):     # no branch in the loop: Triton pipelines its loads
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            at = tl.load(cols_a + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)      # [BK, BR]
            xt = tl.load(rows_x + offs_k[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)  # [BT, BK]
            if SOFT_BF16:   # the interpreter's dot of 16-bit floats is wrong: theirs in fp32 (products exact)
                acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)
        out_ok = mine[:, None] & r_ok[None, :]
        dt = t.dtype.element_ty
        dst = t + offs_t.to(tl.int64)[:, None] * stride_tt + offs_r[None, :]
        if SPLITS == 1:
            tl.store(dst, _round(acc, dt, SOFT_BF16).to(dt), mask=out_ok)
        else:
            rows_part = part + offs_t.to(tl.int64)[:, None] * stride_pt + offs_r[None, :]  # [BT, BR]
            tl.store(rows_part + chunk * stride_ps, acc, mask=out_ok)
            tl.debug_barrier()              # every thread's partial stored before the count says so
            counter = counters + (s * tl.num_programs(1) + r_block) * (tl.num_programs(2) // SPLITS) + row_block
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                total = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
                for c in tl.static_range(SPLITS):
                    total += tl.load(rows_part + c * stride_ps, mask=out_ok, other=0.0, cache_modifier=".cg")
                tl.store(dst, _round(total, dt, SOFT_BF16).to(dt), mask=out_ok)
                tl.atomic_xchg(counter, 0)


@triton.jit(do_not_specialize=["T"])
def _grouped_expand_kernel(t, b, slots, y, T, N, R, S, stride_tt, stride_bs, stride_bn, stride_yt,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           DOT_PREC: tl.constexpr, INTO_DELTA: tl.constexpr, SOFT_BF16: tl.constexpr,
                           PDL: tl.constexpr):
    """Program (slot s, n-block, block of BLOCK_T rows): the block's rows t < T with slots[t] == s (none: nothing
    but the wait) take y[t, n] = round(y[t, n] + sum_r B[s, n, r] t[t, r]) for BLOCK_N outputs n, as one
    tensor-core product of s's tile of B [BN, BR] and those rows' t [BR, BLOCK_T] (other rows' columns zero).
    INTO_DELTA: y is an fp32 delta [T, N] that takes the sum itself, and the programs of s = S write zeros into the
    rows without a slot. DOT_PREC: "ieee" for fp32 (no tf32)."""
    allow_next(PDL)
    s = tl.program_id(0)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    row_slot = tl.load(slots + offs_t, mask=in_t, other=0)                                   # [BT]
    mine = in_t & (tl.where(row_slot < 0, S, row_slot) == s)                             # s = S: no adapter
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_b = b + s.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn      # [BN, 1]
    offs_r = tl.arange(0, BLOCK_R)
    any_row = tl.max(mine.to(tl.int32), 0) > 0
    live_n = n_ok & ((offs_n * 0 + any_row.to(tl.int32)) > 0) & ((offs_n * 0 + s) < S)   # no row, or s = S
    bt = tl.load(rows_b + offs_r[None, :], mask=live_n[:, None] & (offs_r < R)[None, :], other=0.0)
    wait_for_previous(PDL)          # every program waits: this kernel completes only after the one before
    if any_row:
        t_cols = t + offs_t.to(tl.int64)[None, :] * stride_tt                                # [1, BT]
        dst = y + offs_t.to(tl.int64)[None, :] * stride_yt + offs_n[:, None]                # [BN, BT]
        out_ok = n_ok[:, None] & mine[None, :]
        yv = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        if not INTO_DELTA:
            yv = tl.load(dst, mask=out_ok, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for r0 in range(0, R * (s < S).to(tl.int32), BLOCK_R):      # s = S: no rank to sum
            offs_r = r0 + tl.arange(0, BLOCK_R)
            if r0 > 0:
                bt = tl.load(rows_b + offs_r[None, :], mask=n_ok[:, None] & (offs_r < R)[None, :], other=0.0)
            tt = tl.load(t_cols + offs_r[:, None], mask=(offs_r < R)[:, None] & mine[None, :], other=0.0)
            if SOFT_BF16:
                acc = tl.dot(bt.to(tl.float32), tt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(bt, tt, acc, input_precision=DOT_PREC)
        if INTO_DELTA:
            tl.store(dst, acc, mask=out_ok)
        else:
            dt = y.dtype.element_ty
            tl.store(dst, _round(yv + acc, dt, SOFT_BF16).to(dt), mask=out_ok)


@triton.jit
def _add_delta_kernel(y, delta, N, stride_yt, stride_dt, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
                      PDL: tl.constexpr):
    """Program (row, column block): y = round(y + delta), as the expand rounds its sum into y."""
    allow_next(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    dt = y.dtype.element_ty
    yv = tl.load(y + row * stride_yt + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(delta + row * stride_dt + offs, mask=ok, other=0.0)
    tl.store(y + row * stride_yt + offs, _round(yv + d, dt, SOFT_BF16).to(dt), mask=ok)


def counters(device: torch.device, needed: int) -> torch.Tensor:
    """At least `needed` zeroed counters for the shrink's launches on the current stream (stream_counters.py)."""
    out = stream_counters("lora", device, needed, COUNTERS)
    assert out is not None, f"{needed} LoRA counters in a graph's capture: more than its warm-up made"
    return out


def _tiles(rows: int, rank: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_R): the rows and the rank padded to powers of two, at least 16 (an MMA's side)."""
    return (min(MAX_BLOCK_T, max(16, triton.next_power_of_2(rows))),
            min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank))))


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink_(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor, t: torch.Tensor) -> None:
    """t [T, R] = each row's x @ A[slot].T, summed in fp32 and rounded to x's dtype (rows without a slot: untouched)."""
    (rows, k), (n_slots, rank, _) = x.shape, a_stack.shape
    block_t, block_r = _tiles(rows, rank)
    chunk = triton.cdiv(triton.cdiv(k, SPLITS), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, chunk)
    row_blocks, r_blocks = triton.cdiv(rows, block_t), triton.cdiv(rank, block_r)
    part = torch.empty(rows, splits, rank, dtype=torch.float32, device=x.device) if splits > 1 else t
    counts = counters(x.device, n_slots * r_blocks * row_blocks) if splits > 1 else part
    _grouped_shrink_kernel[(n_slots, r_blocks, splits * row_blocks)](
        x, a_stack, slots, part, t, counts, rows, k, rank, chunk, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        part.stride(0), part.stride(1), t.stride(0), SPLITS=splits, BLOCK_T=block_t, BLOCK_R=block_r,
        BLOCK_K=BLOCK_K, DOT_PREC=_dot_prec(x.dtype), SOFT_BF16=_INTERPRETED, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, **pdl.launch_options(x.device))


def expand_(y: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor, t: torch.Tensor,
            into_delta: bool = False) -> None:
    """y [T, N] += each row's t @ B[slot].T, summed in fp32, rounded once (rows without a slot: their bits kept);
    into_delta: y an fp32 [T, N] that takes the sums themselves (rows without a slot: zeros)."""
    (rows, n), (n_slots, _, rank) = y.shape, b_stack.shape
    block_t, block_r = _tiles(rows, rank)
    _grouped_expand_kernel[(n_slots + into_delta, triton.cdiv(n, BLOCK_N), triton.cdiv(rows, block_t))](
        t, b_stack, slots, y, rows, n, rank, n_slots, t.stride(0), b_stack.stride(0), b_stack.stride(1),
        y.stride(0), BLOCK_T=block_t, BLOCK_N=BLOCK_N, BLOCK_R=block_r, DOT_PREC=_dot_prec(b_stack.dtype),
        INTO_DELTA=into_delta, SOFT_BF16=_INTERPRETED, num_warps=NUM_WARPS, **pdl.launch_options(y.device))


def add_delta_(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """y [T, N] = round(y + delta) in place, delta fp32 [T, N] (expand_(into_delta=True)'s): the bits expand_
    gives y itself."""
    assert delta.shape == y.shape and delta.dtype == torch.float32 and y.stride(-1) == delta.stride(-1) == 1
    rows, n = y.shape
    if y.numel():
        block = min(1024, triton.next_power_of_2(n))
        _add_delta_kernel[(rows, triton.cdiv(n, block))](y, delta, n, y.stride(0), delta.stride(0), BLOCK=block,
                                                         SOFT_BF16=_INTERPRETED, num_warps=4,
                                                         **pdl.launch_options(y.device))
    return y


def lora_add_(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              slots: torch.Tensor) -> None:
    """lora_kernels.lora_add_'s grouped launches (its arguments, checked there)."""
    t = torch.empty(x.shape[0], a_stack.shape[1], dtype=x.dtype, device=x.device)
    shrink_(x, a_stack, slots, t)
    expand_(y, b_stack, slots, t)


def grouped_lora_linear(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor,
                        linear: Callable[[], torch.Tensor], defer: bool = False):
    """linear() (x's projection [T, N], unit column stride) plus lora_add_'s deltas, the same bits; in a CUDA graph
    the shrink runs on a side stream beside linear()'s GEMM (side_stream.py), which it needs nothing from (outside
    one the launches follow one another: the side stream's fork and join cost more host time than the overlap
    saves; cuda_ops gives a GPU's eager steps to lora_dense.py).
    defer: the expand too runs beside the GEMM, into an fp32 delta, and the result is (y, delta), the deltas not yet
    added (lora_kernels makes it a compute/pending_delta.py PendingDelta): the kernel that reads y next adds them,
    or add_delta_."""
    t = torch.empty(x.shape[0], a_stack.shape[1], dtype=x.dtype, device=x.device)
    delta = torch.empty(x.shape[0], b_stack.shape[1], dtype=torch.float32, device=x.device) if defer else None

    def needing_only_x():
        shrink_(x, a_stack, slots, t)
        if defer:
            expand_(delta, b_stack, slots, t, into_delta=True)

    if x.is_cuda and torch.cuda.is_current_stream_capturing():     # eager steps are host-bound: no side stream
        with beside(x.device):
            needing_only_x()
        y = linear()
        join(x.device)
    else:
        y = linear()
        needing_only_x()
    if defer:
        return y, delta
    expand_(y, b_stack, slots, t)
    return y


_INTERPRETED = not isinstance(_grouped_shrink_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
