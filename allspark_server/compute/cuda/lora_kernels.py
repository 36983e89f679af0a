"""Triton kernels for multi-adapter LoRA (punica / S-LoRA style): every row of a batch picks its own adapter
from a stack, and y += (x @ A[s].T) @ B[s].T is two launches, a "shrink" to the rank and an "expand" back.

    shrink  grid (T, cdiv(R, BLOCK_R), cdiv(K, K_CHUNK)): program (t, r-block, k-chunk) reads slot s = slots[t]
            (returns at once when s < 0) and sums x[t, k] * A[s, r, k] over its K_CHUNK columns in BLOCK_K tiles in
            fp32 into the scratch part [T, splits, R]: a decode row's shrink is many short programs, not one that
            streams all of K alone (latency-bound: tens of microseconds)
    expand  grid (T, cdiv(N, BLOCK_N)): program (t, n-block) reads s again (returns when s < 0), sums each rank's
            partials over the chunks (one tree, the same for any batch), rounds that to the activation dtype
            (PEFT's lora_A(x) in the module dtype), sums it times B[s, n, :] over R in BLOCK_R chunks in fp32,
            adds y[t, n], rounds once

Ranks are padded with zeros to R (<= 192: q|k|v of rank 64 each); the LoRA scale is folded into B. The grids
come from the shapes alone and nothing is read on the host (CUDA-graph safe: new slots or adapters in the same
buffers replay as they are); a row's sums never depend on the other rows (batch invariant). Program 0 of the
grid varies fastest over rows, so the rows of one tile of A or B run side by side and share it through L2.

A faster version would: group rows by adapter (a sorted row order and per-adapter segments, as punica's SGMV
does) so that one program multiplies a tile of A or B against many rows on the tensor cores (tl.dot) instead of
one row at a time; and fuse the expand into the base GEMM's epilogue, or shrink and expand into one
launch (the rank is small enough for t to stay in registers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.fused_kernels import _gelu_tanh_mul_rounded, _round, _silu_mul_rounded
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK_R = 64    # rank columns a program holds: R = 192 is three shrink programs a row, three expand steps
K_CHUNK = 128       # input columns a shrink program sums (fixed: a row's sums never depend on the batch)
TILE = 4096         # elements of A or B a program holds per step (BLOCK_R * BLOCK_K, BLOCK_N * BLOCK_R)
NUM_WARPS = 4


@triton.jit
def _shrink_kernel(x, a, slots, part, K, R, stride_xt, stride_as, stride_ar, stride_pt, stride_ps,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, r-block, k-chunk): part[row, chunk, r] = sum over the chunk's k of x[row, k] a[s, r, k] in
    fp32, for BLOCK_R ranks r; nothing when s = slots[row] < 0."""
    allow_next(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    if slot < 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows_a = a + slot * stride_as + offs_r.to(tl.int64)[:, None] * stride_ar                  # [BR, 1]
    x += row * stride_xt
    chunk = tl.program_id(2)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        offs_k = chunk * CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xk = tl.load(x + offs_k, mask=k_ok, other=0.0).to(tl.float32)                          # [BK]
        ak = tl.load(rows_a + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BR, BK]
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], 1)
    tl.store(part + row * stride_pt + chunk * stride_ps + offs_r, acc, mask=r_ok)


@triton.jit
def _expand_kernel(part, b, slots, y, N, R, SPLITS, stride_pt, stride_ps, stride_bs, stride_bn, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SOFT_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (row, n-block): t = the shrink's partials summed over its chunks in order, rounded to y's dtype;
    y[row, n] += sum_r t[r] b[s, n, r] in fp32, the sum with y rounded once to y's dtype, for BLOCK_N outputs n;
    nothing when s = slots[row] < 0."""
    allow_next(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_b = b + slot * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn                  # [BN, 1]
    part += row * stride_pt
    dt = y.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        offs_s = tl.arange(0, BLOCK_S)      # every chunk's partial in one load, summed as one tree: the same
        parts = tl.load(part + offs_s[:, None] * stride_ps + offs_r[None, :],              # sum alone or batched
                        mask=(offs_s < SPLITS)[:, None] & r_ok[None, :], other=0.0)                # [BS, BR]
        tr = _round(tl.sum(parts, 0), dt, SOFT_BF16).to(dt).to(tl.float32)                    # [BR]
        br = tl.load(rows_b + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BN, BR]
        acc += tl.sum(br.to(tl.float32) * tr[None, :], 1)
    y += row * stride_yt + offs_n
    out = _round(tl.load(y, mask=n_ok, other=0.0).to(tl.float32) + acc, dt, SOFT_BF16)
    tl.store(y, out.to(dt), mask=n_ok)


@triton.jit
def _shrink_grouped_kernel(x, a, order, seg, part, K, R, stride_xt, stride_as, stride_ar, stride_pt, stride_ps,
                           BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (slot, r-block, k-chunk): the slot's tile of A [BLOCK_R, CHUNK] loaded once, then for each of its rows
    (order[seg[slot + 1]:seg[slot + 2]]) part[row, chunk, r] = sum over the chunk's k of x[row, k] a[slot, r, k]."""
    allow_next(PDL)
    wait_for_previous(PDL)
    slot = tl.program_id(0)
    lo = tl.load(seg + slot + 1)
    hi = tl.load(seg + slot + 2)
    if lo >= hi:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    chunk = tl.program_id(2)
    offs_k = chunk * CHUNK + tl.arange(0, CHUNK)
    r_ok, k_ok = offs_r < R, offs_k < K
    tile = tl.load(a + slot.to(tl.int64) * stride_as + offs_r.to(tl.int64)[:, None] * stride_ar + offs_k[None, :],
                   mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)                    # [BR, CHUNK]
    for i in range(lo, hi):
        row = tl.load(order + i).to(tl.int64)
        xk = tl.load(x + row * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)             # [CHUNK]
        tl.store(part + row * stride_pt + chunk * stride_ps + offs_r, tl.sum(tile * xk[None, :], 1), mask=r_ok)


@triton.jit
def _expand_grouped_kernel(part, b, order, seg, y, N, R, SPLITS, stride_pt, stride_ps, stride_bs, stride_bn,
                           stride_yt, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                           SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (slot, n-block): the slot's tile of B [BLOCK_N, R] (R <= BLOCK_R) loaded once, then for each of its
    rows the expand of _expand_kernel (partials summed as one tree, rounded, times B, added to y, rounded once)."""
    allow_next(PDL)
    wait_for_previous(PDL)
    slot = tl.program_id(0)
    lo = tl.load(seg + slot + 1)
    hi = tl.load(seg + slot + 2)
    if lo >= hi:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    n_ok, r_ok = offs_n < N, offs_r < R
    tile = tl.load(b + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :],
                   mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)                    # [BN, BR]
    dt = y.dtype.element_ty
    for i in range(lo, hi):
        row = tl.load(order + i).to(tl.int64)
        parts = tl.load(part + row * stride_pt + offs_s[:, None] * stride_ps + offs_r[None, :],
                        mask=(offs_s < SPLITS)[:, None] & r_ok[None, :], other=0.0)                 # [BS, BR]
        tr = _round(tl.sum(parts, 0), dt, SOFT_BF16).to(dt).to(tl.float32)                         # [BR]
        acc = tl.sum(tile * tr[None, :], 1)
        out = y + row * stride_yt + offs_n
        tl.store(out, _round(tl.load(out, mask=n_ok, other=0.0).to(tl.float32) + acc, dt, SOFT_BF16).to(dt),
                 mask=n_ok)


@triton.jit
def _expand_rows_kernel(t, b, slots, y, out, N, R, up_cols, stride_tm, stride_bs, stride_bn, stride_ym, stride_om,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACT: tl.constexpr, SOFT_BF16: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (row, n-block): y[row, n] += sum_r t[row, r] b[s, n, r] in fp32, the sum with y rounded once to y's
    dtype, for BLOCK_N outputs n, s = slots[row] (t: the shrink, already rounded); nothing when s < 0. ACT (1 silu,
    2 gelu-tanh): y [M, 2 up_cols] is a gate|up projection, both halves get their deltas, and out[row, n] =
    act(gate) * up is written (rounded as ops.silu_mul / gelu_tanh_mul round), y left as it was. The slot and the
    first BLOCK_R ranks of B are read before the PDL wait (slots: written by the step's host-to-device copies)."""
    allow_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    slot = tl.load(slots + row).to(tl.int64)
    rows_b = b + tl.maximum(slot, 0) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn        # [BN, 1]
    offs_r = tl.arange(0, BLOCK_R)
    live = n_ok & ((offs_n * 0 + slot) >= 0)                                           # nothing to read: s < 0
    ok = live[:, None] & (offs_r < R)[None, :]
    b_first = tl.load(rows_b + offs_r[None, :], mask=ok, other=0.0)                                  # [BN, BR]
    b_first_up = b_first
    if ACT != 0:
        b_first_up = tl.load(rows_b + up_cols * stride_bn + offs_r[None, :], mask=ok, other=0.0)
    wait_for_previous(PDL)
    dt = y.dtype.element_ty
    y += row * stride_ym + offs_n
    gate = tl.load(y, mask=n_ok, other=0.0).to(tl.float32)
    up = gate
    if ACT != 0:
        up = tl.load(y + up_cols, mask=n_ok, other=0.0).to(tl.float32)
    if slot >= 0:
        t += row * stride_tm
        tr = tl.load(t + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)[None, :]                  # [1, BR]
        acc = tl.sum(b_first.to(tl.float32) * tr, 1)
        acc_up = tl.sum(b_first_up.to(tl.float32) * tr, 1)
        for r0 in range(BLOCK_R, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            tr = tl.load(t + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
            ok = n_ok[:, None] & r_ok[None, :]
            acc += tl.sum(tl.load(rows_b + offs_r[None, :], mask=ok, other=0.0).to(tl.float32) * tr, 1)
            if ACT != 0:
                acc_up += tl.sum(tl.load(rows_b + up_cols * stride_bn + offs_r[None, :], mask=ok,
                                         other=0.0).to(tl.float32) * tr, 1)
        gate = _round(gate + acc, dt, SOFT_BF16)
        if ACT == 0:
            tl.store(y, gate.to(dt), mask=n_ok)
        else:
            up = _round(up + acc_up, dt, SOFT_BF16)
    if ACT == 1:
        tl.store(out + row * stride_om + offs_n, _silu_mul_rounded(gate, up, dt, SOFT_BF16).to(dt), mask=n_ok)
    if ACT == 2:
        tl.store(out + row * stride_om + offs_n, _gelu_tanh_mul_rounded(gate, up, dt, SOFT_BF16).to(dt), mask=n_ok)


EXPAND_ACTS = {None: 0, "silu": 1, "gelu_tanh": 2}


def expand_rows_(y: torch.Tensor, t: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor,
                 act: str | None = None) -> torch.Tensor:
    """The expand after gemv_kernels.gemv_shrink: y [M, N] += t[m] @ b_stack[slots[m]].T for the rows with an
    adapter (the sums and roundings of lora_add_'s expand; rows with slots[m] < 0 keep their bits); returns y.
    act "silu" / "gelu_tanh": y is a gate|up projection [M, 2I]; returns act(gate) * up [M, I] (ops.silu_mul /
    gelu_tanh_mul of the updated y, in the same launch; y itself is not written). One launch, a program per row
    and BLOCK_N outputs; slots written by a host-to-device copy (read before the PDL wait), never on the host."""
    rows, n = y.shape
    slots_n, n_b, rank = b_stack.shape
    assert n_b == n and t.shape == (rows, rank) and slots.shape == (rows,), \
        f"y {tuple(y.shape)}, t {tuple(t.shape)}, b_stack {tuple(b_stack.shape)}, slots {tuple(slots.shape)}"
    assert y.dtype == t.dtype == b_stack.dtype and y.dtype in DTYPES and slots.dtype in (torch.int64, torch.int32)
    for z in (y, t, b_stack):
        assert z.stride(-1) == 1, "unit stride in the last dim"
    code = EXPAND_ACTS[act]
    assert not code or n % 2 == 0, f"gate|up of odd width {n}"
    cols = n // 2 if code else n
    out = torch.empty(rows, cols, dtype=y.dtype, device=y.device) if code else y
    if rows == 0 or cols == 0:
        return out
    block_r = max(16, min(MAX_BLOCK_R, triton.next_power_of_2(rank)))
    block_n = min(triton.next_power_of_2(cols), max(16, TILE // block_r))
    _expand_rows_kernel[(rows, triton.cdiv(cols, block_n))](
        t, b_stack, slots, y, out, cols, rank, n // 2, t.stride(0), b_stack.stride(0), b_stack.stride(1),
        y.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_R=block_r, ACT=code, SOFT_BF16=_INTERPRETED,
        num_warps=NUM_WARPS, **pdl.launch_options(y.device))
    return out


GROUPED_MAX_ROWS = 64   # decode batches: rows grouped by slot share each tile of A and B; more rows: a program a row


def group_rows(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, seg) for the grouped kernels from each row's slot, with device ops only (capturable): the rows
    sorted by slot (stable) and seg [num_slots + 2], slot s's rows being order[seg[s + 1]:seg[s + 2]] (rows
    without an adapter, slot -1, come first)."""
    order = torch.argsort(slots, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=slots.device)
    counts.scatter_add_(0, slots.long() + 1, torch.ones_like(slots, dtype=torch.long))
    return order, torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def blocks(rank: int, k: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_N) for rank R, input K and output N: the rank padded to a power of two up to
    MAX_BLOCK_R, and K- and N-tiles that make a tile of A or B TILE elements (fewer when K or N is smaller)."""
    block_r = min(MAX_BLOCK_R, triton.next_power_of_2(rank))
    return (block_r, min(triton.next_power_of_2(k), max(16, TILE // block_r)),
            min(triton.next_power_of_2(n), max(16, TILE // block_r)))


def lora_add_(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              slots: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """y [T, N] += (x[t] @ a_stack[s].T) @ b_stack[s].T for every row t with s = slots[t] >= 0; rows with
    slots[t] < 0 keep their bits. x [T, K]; a_stack [S, R, K]; b_stack [S, N, R] (ranks padded with zeros to
    R, the scale folded into B); slots int64 or int32 [T], each < S (not checked: that would read it on the
    host). x, the stacks and y in one dtype (fp32, bf16, fp16); x and y any row stride, unit column stride
    (y may be a column slice of a wider output). The shrink's result is rounded to that dtype before the
    expand, as PEFT does; the expand sums in fp32 and rounds once into y. Two launches, a scratch of fp32
    partials [T, K / K_CHUNK, R]. `groups`: group_rows(slots, S) where the caller has it (one per step): at most
    GROUPED_MAX_ROWS rows with R <= MAX_BLOCK_R then take the grouped kernels (each tile of A and B read once
    per slot, not once per row); the same sums either way."""
    rows, k = x.shape
    slots_n, rank, k_a = a_stack.shape
    n = y.shape[1]
    assert y.dim() == 2 and y.shape[0] == rows, f"y {tuple(y.shape)} vs x {tuple(x.shape)}"
    assert k_a == k and b_stack.shape == (slots_n, n, rank), \
        f"x {tuple(x.shape)}, a_stack {tuple(a_stack.shape)}, b_stack {tuple(b_stack.shape)}, y {tuple(y.shape)}"
    assert x.dtype == a_stack.dtype == b_stack.dtype == y.dtype and x.dtype in DTYPES, "one float dtype"
    assert slots.shape == (rows,) and slots.dtype in (torch.int64, torch.int32), "slots: int32 / int64 [T]"
    for z in (x, a_stack, b_stack, y):
        assert z.stride(-1) == 1, "unit stride in the last dim"
    assert slots.device == x.device == y.device == a_stack.device == b_stack.device
    if rows == 0 or rank == 0 or n == 0:
        return
    block_r, block_k, block_n = blocks(rank, k, n)
    # one [BLOCK_R, chunk] tile a program, grouped or not: the same sums for a row in any batch
    chunk = max(block_k, K_CHUNK)
    splits = triton.cdiv(k, chunk)
    part = torch.empty(rows, splits, rank, dtype=torch.float32, device=x.device)                  # [T, splits, R]
    if groups is not None and rows <= GROUPED_MAX_ROWS and rank <= MAX_BLOCK_R and chunk == K_CHUNK:
        order, seg = groups
        _shrink_grouped_kernel[(slots_n, 1, splits)](
            x, a_stack, order, seg, part, k, rank, x.stride(0), a_stack.stride(0), a_stack.stride(1),
            part.stride(0), part.stride(1), BLOCK_R=block_r, CHUNK=chunk, num_warps=NUM_WARPS,
            **pdl.launch_options(x.device))
        _expand_grouped_kernel[(slots_n, triton.cdiv(n, block_n))](
            part, b_stack, order, seg, y, n, rank, splits, part.stride(0), part.stride(1), b_stack.stride(0),
            b_stack.stride(1), y.stride(0), BLOCK_N=block_n, BLOCK_R=block_r,
            BLOCK_S=triton.next_power_of_2(splits), SOFT_BF16=_INTERPRETED, num_warps=NUM_WARPS,
            **pdl.launch_options(y.device))
        return
    _shrink_kernel[(rows, triton.cdiv(rank, block_r), splits)](
        x, a_stack, slots, part, k, rank, x.stride(0), a_stack.stride(0), a_stack.stride(1), part.stride(0),
        part.stride(1), BLOCK_R=block_r, BLOCK_K=chunk, CHUNK=chunk, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        part, b_stack, slots, y, n, rank, splits, part.stride(0), part.stride(1), b_stack.stride(0),
        b_stack.stride(1), y.stride(0), BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_S=triton.next_power_of_2(splits), SOFT_BF16=_INTERPRETED,
        num_warps=NUM_WARPS, **pdl.launch_options(y.device))


_INTERPRETED = not isinstance(_shrink_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
