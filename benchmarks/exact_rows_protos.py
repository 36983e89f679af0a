"""The prototype kernels that benchmarks/exact_rows_micro.py races for invariant rows (a GEMV whose rows come out as
they would alone): `fma_rows` (each row an elementwise fp32 accumulator across the k-tiles, reduced once), `dot_rows`
(tensor cores, x padded to 16 rows as the MMA's N side), `dot_pdl` (the same with the first weight tile read before
the PDL wait: what gemv_kernels._rows_dot_kernel became) and `dot_tma` (its weight and x fed by TMA descriptors).
"""
from __future__ import annotations

import torch
from cuda_common import device  # first: it sets Triton's interpreter without a GPU

ON_GPU = device() == "cuda"     # below: Triton, read once the interpreter is set

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from allspark_server.compute.cuda import pdl  # noqa: E402
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous  # noqa: E402


@triton.jit
def _row_acc(acc, wt, x, i: tl.constexpr, ROWS: tl.constexpr, M, offs_k, K, stride_xm):
    """Row i's elementwise accumulator plus the tile's products (unchanged past ROWS)."""
    if i < ROWS:
        xi = tl.load(x + tl.minimum(i, M - 1) * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        acc = acc + wt * xi[None, :]
    return acc


@triton.jit
def _row_store(acc, out, i: tl.constexpr, ROWS: tl.constexpr, M, offs_n, n_ok, stride_om):
    if i < ROWS:
        if i < M:
            tl.store(out + i * stride_om + offs_n, tl.sum(acc, 1).to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def fma_rows_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Up to 8 rows a program, each an fp32 accumulator per element of the tile (a0..a7), reduced once at the end:
    a row's tree is the same whatever ROWS is."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        a0, a1 = _row_acc(a0, wt, x, 0, ROWS, M, offs_k, K, stride_xm), _row_acc(a1, wt, x, 1, ROWS, M, offs_k, K,
                                                                                stride_xm)
        a2, a3 = _row_acc(a2, wt, x, 2, ROWS, M, offs_k, K, stride_xm), _row_acc(a3, wt, x, 3, ROWS, M, offs_k, K,
                                                                                stride_xm)
        a4, a5 = _row_acc(a4, wt, x, 4, ROWS, M, offs_k, K, stride_xm), _row_acc(a5, wt, x, 5, ROWS, M, offs_k, K,
                                                                                stride_xm)
        a6, a7 = _row_acc(a6, wt, x, 6, ROWS, M, offs_k, K, stride_xm), _row_acc(a7, wt, x, 7, ROWS, M, offs_k, K,
                                                                                stride_xm)
    _row_store(a0, out, 0, ROWS, M, offs_n, n_ok, stride_om), _row_store(a1, out, 1, ROWS, M, offs_n, n_ok, stride_om)
    _row_store(a2, out, 2, ROWS, M, offs_n, n_ok, stride_om), _row_store(a3, out, 3, ROWS, M, offs_n, n_ok, stride_om)
    _row_store(a4, out, 4, ROWS, M, offs_n, n_ok, stride_om), _row_store(a5, out, 5, ROWS, M, offs_n, n_ok, stride_om)
    _row_store(a6, out, 6, ROWS, M, offs_n, n_ok, stride_om), _row_store(a7, out, 7, ROWS, M, offs_n, n_ok, stride_om)


@triton.jit
def dot_rows_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if EVICT:
            wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                         eviction_policy="evict_first")
        else:
            wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(wt, xt, acc)
    tl.store(out + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out.dtype.element_ty),
             mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def dot_rows_pdl_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    allow_next(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous(PDL)
    xt = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
    acc = tl.dot(wt, xt)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_first")
        xt = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(wt, xt, acc)
    tl.store(out + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out.dtype.element_ty),
             mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def dot_tma_kernel(x_desc, w_desc, out, M, N, K, stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    allow_next(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    wt = w_desc.load([n0, 0])
    wait_for_previous(PDL)
    xt = x_desc.load([0, 0])
    acc = tl.dot(wt, tl.trans(xt))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        wt = w_desc.load([n0, k0])
        xt = x_desc.load([0, k0])
        acc = tl.dot(wt, tl.trans(xt), acc)
    tl.store(out + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out.dtype.element_ty),
             mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


def dot_tma(x, w, bn, bk, warps, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = x.shape
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    dot_tma_kernel[(triton.cdiv(w.shape[0], bn),)](TensorDescriptor.from_tensor(x, [16, bk]),
                                                  TensorDescriptor.from_tensor(w, [bn, bk]), out, m, w.shape[0], k,
                                                  out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                  num_stages=stages, **pdl.launch_options(x.device))
    return out


def dot_pdl(x, w, bn, bk, warps, stages):
    m, k = x.shape
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    dot_rows_pdl_kernel[(triton.cdiv(w.shape[0], bn),)](x, w, out, m, w.shape[0], k, x.stride(0), w.stride(0),
                                                       out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                       num_stages=stages, **pdl.launch_options(x.device))
    return out


def fma_rows(x, w, bn, bk, warps, rows_per_program=8):
    m, k = x.shape
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    rows = min(rows_per_program, triton.next_power_of_2(m)) if m > 1 else 1
    for r0 in range(0, m, rows):
        xs, os = x[r0:r0 + rows], out[r0:r0 + rows]
        fma_rows_kernel[(triton.cdiv(w.shape[0], bn),)](xs, w, os, xs.shape[0], w.shape[0], k, xs.stride(0),
                                                       w.stride(0), os.stride(0), ROWS=rows, BLOCK_N=bn,
                                                       BLOCK_K=bk, num_warps=warps, num_stages=1,
                                                       enable_fp_fusion=False)
    return out


def dot_rows(x, w, bn, bk, warps, stages, evict=True):
    m, k = x.shape
    assert m <= 16
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    dot_rows_kernel[(triton.cdiv(w.shape[0], bn),)](x, w, out, m, w.shape[0], k, x.stride(0), w.stride(0),
                                                   out.stride(0), BLOCK_N=bn, BLOCK_K=bk, EVICT=evict,
                                                   num_warps=warps, num_stages=stages)
    return out
