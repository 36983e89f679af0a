"""Triton kernels for multi-adapter LoRA (punica / S-LoRA style): every row of a batch picks its own adapter
from a stack, and y += (x @ A[s].T) @ B[s].T is two launches, a "shrink" to the rank and an "expand" back.

    shrink  grid (T, cdiv(R, BLOCK_R), cdiv(K, K_CHUNK)): program (t, r-block, k-chunk) reads slot s = slots[t]
            (does nothing when s < 0) and sums x[t, k] * A[s, r, k] over its K_CHUNK columns in BLOCK_K tiles in
            fp32 into the scratch part [T, splits, R]: a decode row's shrink is many short programs, not one that
            streams all of K alone (latency-bound: tens of microseconds)
    expand  grid (T, cdiv(N, BLOCK_N)): program (t, n-block) reads s again (nothing when s < 0), sums each rank's
            partials over the chunks (one tree, the same for any batch), rounds that to the activation dtype
            (PEFT's lora_A(x) in the module dtype), sums it times B[s, n, :] over R in BLOCK_R chunks in fp32,
            adds y[t, n], rounds once

Many rows (lora_add_'s `grouped`) take lora_grouped.py's launches instead: a program an adapter slot and block of
rows on tensor cores.

Ranks are padded with zeros to R (<= 192: q|k|v of rank 64 each); the LoRA scale is folded into B. The grids
come from the shapes alone and nothing is read on the host (CUDA-graph safe: new slots or adapters in the same
buffers replay as they are); a row's sums never depend on the other rows (batch invariant). Program 0 of the
grid varies fastest over rows, so the rows of one tile of A or B run side by side and share it through L2.

What a decode step pays for them is latency, not bytes: each launch's programs wait (PDL) for the kernel before,
then run a chain of dependent loads. So each program reads its row's slot and its first tile of A or B before the
wait (`slots` comes from the step's host-to-device copies, never from a kernel: pdl.py's contract), leaving one
load of x or of the partials after it. On an H200 (7B shape, rank 16 on all seven modules) that took the batch-1
adapter step from 0.82x to 0.90x the base model's; grouping a batch's rows by adapter (each tile read once per
adapter, the rows in a loop) gave 0.82x (benchmarks/lora_kernels_micro.py, lora.py). Decode rows the Triton GEMV
takes carry the shrink's programs in the GEMV's own launch (`Shrink`, gemv_kernels.gemv), so only the expand needs
a launch of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import lora_grouped, pdl
from allspark_server.compute.cuda.fused_kernels import _round
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous
from allspark_server.compute.pending_delta import PendingDelta

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK_R = 64    # rank columns a program holds: R = 192 is three shrink programs a row, three expand steps
K_CHUNK = 128       # input columns a shrink program sums (fixed: a row's sums never depend on the batch)
TILE = 4096         # elements of A or B a program holds per step (BLOCK_R * BLOCK_K, BLOCK_N * BLOCK_R)
NUM_WARPS = 4
# the shrink's warps: those of the GEMV launch that may carry it (gemv_kernels.choose_config), so that a shrink
# program's tile is laid out, and its sum taken, the same in either launch (gemv_kernels._launch checks it)
SHRINK_WARPS = 8


@triton.jit
def shrink_program(row, r_block, chunk, x, a, slots, part, K, R, stride_xt, stride_as, stride_ar, stride_pt,
                   stride_ps, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Shrink program (row, r-block, k-chunk): part[row, chunk, r] = sum over the chunk's k of x[row, k] a[s, r, k]
    in fp32, for BLOCK_R ranks r; nothing when s = slots[row] < 0. The slot and the first tile of A are read before
    the PDL wait (slots: written by the step's host-to-device copies, pdl.py). _shrink_kernel's programs, and the
    first programs of a GEMV launch that carries the shrink (gemv_kernels)."""
    row = row.to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows_a = a + tl.maximum(slot, 0) * stride_as + offs_r.to(tl.int64)[:, None] * stride_ar    # [BR, 1]
    offs_k = chunk * CHUNK + tl.arange(0, BLOCK_K)
    live = r_ok & ((offs_r * 0 + slot) >= 0)                                            # nothing to read: s < 0
    ak = tl.load(rows_a + offs_k[None, :], mask=live[:, None] & (offs_k < K)[None, :], other=0.0)  # [BR, BK]
    wait_for_previous(PDL)
    if slot >= 0:
        x += row * stride_xt
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, CHUNK, BLOCK_K):
            offs_k = chunk * CHUNK + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if k0 > 0:
                ak = tl.load(rows_a + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            xk = tl.load(x + offs_k, mask=k_ok, other=0.0).to(tl.float32)                      # [BK]
            acc += tl.sum(ak.to(tl.float32) * xk[None, :], 1)
        tl.store(part + row * stride_pt + chunk * stride_ps + offs_r, acc, mask=r_ok)


@triton.jit
def _shrink_kernel(x, a, slots, part, K, R, stride_xt, stride_as, stride_ar, stride_pt, stride_ps,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, r-block, k-chunk): shrink_program's."""
    allow_next(PDL)
    shrink_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), x, a, slots, part, K, R, stride_xt,
                   stride_as, stride_ar, stride_pt, stride_ps, BLOCK_R, BLOCK_K, CHUNK, PDL)


@triton.jit
def expand_program(row, n_block, part, b, slots, y, N, R, SPLITS, stride_pt, stride_ps, stride_bs, stride_bn,
                   stride_yt, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                   SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Expand program (row, n-block): t = the shrink's partials summed over its chunks in order, rounded to y's
    dtype; y[row, n] += sum_r t[r] b[s, n, r] in fp32, the sum with y rounded once to y's dtype, for BLOCK_N outputs
    n; nothing when s = slots[row] < 0. The slot and the first BLOCK_R ranks of B are read before the PDL wait."""
    row = row.to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_b = b + tl.maximum(slot, 0) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn    # [BN, 1]
    offs_r = tl.arange(0, BLOCK_R)
    live = n_ok & ((offs_n * 0 + slot) >= 0)                                            # nothing to read: s < 0
    br = tl.load(rows_b + offs_r[None, :], mask=live[:, None] & (offs_r < R)[None, :], other=0.0)  # [BN, BR]
    wait_for_previous(PDL)
    if slot >= 0:
        part += row * stride_pt
        dst = y + row * stride_yt + offs_n
        yv = tl.load(dst, mask=n_ok, other=0.0).to(tl.float32)
        dt = y.dtype.element_ty
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            offs_s = tl.arange(0, BLOCK_S)      # every chunk's partial in one load, summed as one tree: the same
            parts = tl.load(part + offs_s[:, None] * stride_ps + offs_r[None, :],          # sum alone or batched
                            mask=(offs_s < SPLITS)[:, None] & r_ok[None, :], other=0.0)           # [BS, BR]
            tr = _round(tl.sum(parts, 0), dt, SOFT_BF16).to(dt).to(tl.float32)                    # [BR]
            if r0 > 0:
                br = tl.load(rows_b + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            acc += tl.sum(br.to(tl.float32) * tr[None, :], 1)
        tl.store(dst, _round(yv + acc, dt, SOFT_BF16).to(dt), mask=n_ok)


@triton.jit
def _expand_kernel(part, b, slots, y, N, R, SPLITS, stride_pt, stride_ps, stride_bs, stride_bn, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SOFT_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (row, n-block): expand_program's."""
    allow_next(PDL)
    expand_program(tl.program_id(0), tl.program_id(1), part, b, slots, y, N, R, SPLITS, stride_pt, stride_ps,
                   stride_bs, stride_bn, stride_yt, BLOCK_N, BLOCK_R, BLOCK_S, SOFT_BF16, PDL)


def blocks(rank: int, k: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_N) for rank R, input K and output N: the rank padded to a power of two up to
    MAX_BLOCK_R, and K- and N-tiles that make a tile of A or B TILE elements (fewer when K or N is smaller)."""
    block_r = min(MAX_BLOCK_R, triton.next_power_of_2(rank))
    return (block_r, min(triton.next_power_of_2(k), max(16, TILE // block_r)),
            min(triton.next_power_of_2(n), max(16, TILE // block_r)))


@dataclass(frozen=True)
class Shrink:
    """One projection's LoRA rows between the shrink and the expand: the stacks, each row's slot, the fp32 partials
    part [T, splits, R] the shrink programs write, and the tiles both halves use."""
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    slots: torch.Tensor
    part: torch.Tensor
    block_r: int
    block_n: int
    chunk: int

    @property
    def rank(self) -> int:
        return self.a_stack.shape[1]

    @property
    def splits(self) -> int:
        return self.part.shape[1]

    @property
    def block_s(self) -> int:
        """Every chunk's partial in one tile, summed as one tree."""
        return triton.next_power_of_2(self.splits)

    @property
    def r_blocks(self) -> int:
        return triton.cdiv(self.rank, self.block_r)

    @property
    def programs(self) -> int:
        """Shrink programs: (row, r-block, k-chunk), the chunk fastest."""
        return self.part.shape[0] * self.r_blocks * self.splits

    @classmethod
    def of(cls, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> "Shrink":
        """The plan of (x[t] @ a_stack[s].T) @ b_stack[s].T for x [T, K] (lora_add_'s arguments, checked)."""
        check_operands(x, a_stack, b_stack, slots)
        rows, k = x.shape
        rank, n = a_stack.shape[1], b_stack.shape[1]
        block_r, block_k, block_n = blocks(max(rank, 1), k, max(n, 1))
        chunk = max(block_k, K_CHUNK)    # one [BLOCK_R, chunk] tile a program: a row's sums the same in any batch
        part = torch.empty(rows, triton.cdiv(k, chunk), rank, dtype=torch.float32, device=x.device)
        return cls(a_stack, b_stack, slots, part, block_r, block_n, chunk)

    @property
    def empty(self) -> bool:
        return self.part.numel() == 0 or self.b_stack.shape[1] == 0


def check_operands(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> None:
    """lora_add_'s x, stacks and slots: shapes, one float dtype, unit last strides, one device."""
    rows, k = x.shape
    slots_n, rank, k_a = a_stack.shape
    n = b_stack.shape[1]
    assert k_a == k and b_stack.shape == (slots_n, n, rank), \
        f"x {tuple(x.shape)}, a_stack {tuple(a_stack.shape)}, b_stack {tuple(b_stack.shape)}"
    assert x.dtype == a_stack.dtype == b_stack.dtype and x.dtype in DTYPES, "one float dtype"
    assert slots.shape == (rows,) and slots.dtype in (torch.int64, torch.int32), "slots: int32 / int64 [T]"
    for z in (x, a_stack, b_stack):
        assert z.stride(-1) == 1, "unit stride in the last dim"
    assert slots.device == x.device == a_stack.device == b_stack.device


def _no_delta(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor) -> bool:
    """Nothing to add: no rows, no input columns, no rank or no outputs (Shrink.empty, without its partials)."""
    return 0 in (x.shape[0], x.shape[1], a_stack.shape[1], b_stack.shape[1])


def shrink_(x: torch.Tensor, s: Shrink) -> None:
    """The shrink's launch: s.part from x."""
    _shrink_kernel[(x.shape[0], s.r_blocks, s.splits)](
        x, s.a_stack, s.slots, s.part, x.shape[1], s.rank, x.stride(0), s.a_stack.stride(0), s.a_stack.stride(1),
        s.part.stride(0), s.part.stride(1), BLOCK_R=s.block_r, BLOCK_K=s.chunk, CHUNK=s.chunk,
        num_warps=SHRINK_WARPS, **pdl.launch_options(x.device))


def expand_(y: torch.Tensor, s: Shrink) -> None:
    """The expand's launch, a program a row: y += each row's partials summed, rounded, times its slot's B."""
    n = y.shape[1]
    _expand_kernel[(y.shape[0], triton.cdiv(n, s.block_n))](
        s.part, s.b_stack, s.slots, y, n, s.rank, s.splits, s.part.stride(0), s.part.stride(1), s.b_stack.stride(0),
        s.b_stack.stride(1), y.stride(0), BLOCK_N=s.block_n, BLOCK_R=s.block_r, BLOCK_S=s.block_s,
        SOFT_BF16=_INTERPRETED, num_warps=NUM_WARPS, **pdl.launch_options(y.device))


def lora_add_(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              slots: torch.Tensor, grouped: bool = False) -> None:
    """y [T, N] += (x[t] @ a_stack[s].T) @ b_stack[s].T for every row t with s = slots[t] >= 0; rows with
    slots[t] < 0 keep their bits. x [T, K]; a_stack [S, R, K]; b_stack [S, N, R] (ranks padded with zeros to
    R, the scale folded into B); slots int64 or int32 [T], each < S (not checked: that would read it on the
    host), written by a host-to-device copy (the kernels read it before the PDL wait: pdl.py). x, the stacks
    and y in one dtype (fp32, bf16, fp16); x and y any row stride, unit column stride (y may be a column slice
    of a wider output). The shrink's result is rounded to that dtype before the expand, as PEFT does; the
    expand sums in fp32 and rounds once into y. Two launches, a scratch of fp32 partials [T, K / K_CHUNK, R].
    grouped: both launches a program an adapter slot on tensor cores, each tile of A and B read once for a block
    of rows (lora_grouped.py: batches of many rows; a row's sums in another order than here, each row still the
    same in any batch)."""
    check_operands(x, a_stack, b_stack, slots)
    _check_output(y, x, b_stack)
    if _no_delta(x, a_stack, b_stack):
        return
    if grouped:
        lora_grouped.lora_add_(y, x, a_stack, b_stack, slots)
    else:
        s = Shrink.of(x, a_stack, b_stack, slots)
        shrink_(x, s)
        expand_(y, s)


def grouped_lora_linear(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor,
                        linear: Callable[[], torch.Tensor], defer: bool = False):
    """linear() (x's projection [T, N]) plus lora_add_(..., grouped=True)'s deltas, the same bits, the shrink
    beside linear()'s GEMM in a CUDA graph (lora_grouped.grouped_lora_linear). defer: the expand beside it too, and
    a PendingDelta (compute/pending_delta.py) for the next kernel to add."""
    check_operands(x, a_stack, b_stack, slots)
    if _no_delta(x, a_stack, b_stack):
        return linear()
    out = lora_grouped.grouped_lora_linear(x, a_stack, b_stack, slots, linear, defer=defer)
    _check_output(out[0] if defer else out, x, b_stack)
    return PendingDelta(*out) if defer else out


def _check_output(y: torch.Tensor, x: torch.Tensor, b_stack: torch.Tensor) -> None:
    assert y.dim() == 2 and y.shape == (x.shape[0], b_stack.shape[1]) and y.dtype == x.dtype, \
        f"y {tuple(y.shape)} {y.dtype} for x {tuple(x.shape)}, b_stack {tuple(b_stack.shape)}"
    assert y.stride(-1) == 1 and y.device == x.device, "y: unit stride in the last dim, on x's device"


_INTERPRETED = not isinstance(_shrink_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
