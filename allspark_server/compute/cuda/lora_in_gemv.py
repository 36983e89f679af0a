"""The LoRA adapter's shrink inside the decode GEMV's launch (gemv_kernels.gemv_shrink), and its expand as one small
launch after it (lora_kernels.expand_rows_): a decode row's adapter costs one launch, not two, and gate|up's expand
takes the MLP's silu·mul with it.

The GEMV launch's first programs are the shrink: program q computes BLOCK_N ranks of t[row] = x[row] . A[s].T (s the
row's slot; the fp32 sum rounded to x's dtype: PEFT's lora_A(x) in the module dtype) into t [M, R]; the GEMV's own
programs follow, unchanged. First in the grid, the shrink programs start with the GEMV's first wave and are done
before its last. The row's slot is read before the PDL wait: `slots` is written by the step's host-to-device copies
before its first kernel, never by a kernel of the step (pdl.py's contract), so the slot's first tile of A streams
while the kernel before still runs."""
from __future__ import annotations

import triton
import triton.language as tl

from allspark_server.compute.cuda.fused_kernels import _round
from allspark_server.compute.cuda.pdl import wait_for_previous


@triton.jit
def shrink_program(q, x, a_stack, slots, t_buf, K, R, stride_xm, stride_as, stride_ar, stride_tm,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICTION: tl.constexpr, SOFT_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    """Shrink program q: t_buf[row, r] = sum_k x[row, k] A[s, r, k] in fp32, rounded once to x's dtype, for
    BLOCK_N ranks r of row q // cdiv(R, BLOCK_N), s = slots[row]; nothing when s < 0."""
    r_blocks = tl.cdiv(R, BLOCK_N)
    row = (q // r_blocks).to(tl.int64)
    offs_r = (q % r_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots + row).to(tl.int64)
    if slot >= 0:
        r_ok = offs_r < R
        rows = a_stack + slot * stride_as + offs_r.to(tl.int64)[:, None] * stride_ar                # [BN, 1]
        offs_k = tl.arange(0, BLOCK_K)
        at = tl.load(rows + offs_k[None, :], mask=r_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                     eviction_policy=EVICTION)                                                     # [BN, BK]
        wait_for_previous(PDL)
        x += row * stride_xm
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if k0 > 0:
                at = tl.load(rows + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0,
                             eviction_policy=EVICTION)
            acc += tl.sum(at.to(tl.float32) * tl.load(x + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :], 1)
        dt = t_buf.dtype.element_ty
        tl.store(t_buf + row * stride_tm + offs_r, _round(acc, dt, SOFT_BF16).to(dt), mask=r_ok)
