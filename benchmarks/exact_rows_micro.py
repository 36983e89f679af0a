"""Prototype race: GEMV kernels whose rows come out bit for bit as they would alone, for a speculative verify
chunk (k + 1 rows of one sequence) at the cost of about one weight read.

  fma: each row keeps an elementwise fp32 accumulator [BN, BK] across the k-tiles, reduced once at the end
       (the weight tile is loaded once and met by every row; the per-row tree does not depend on ROWS).
  dot: tensor cores, swap-AB: out^T [BN, 16] = w [BN, BK] @ x^T [BK, 16], x padded to 16 rows, so the compiled
       kernel and its instruction sequence are the same for 1..16 rows.
Against the production kernel at one row and in alone-rows mode (a program per row), and cuBLAS.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from cuda_common import copies_past_l2, device, per_call_us  # first: it sets Triton's interpreter without a GPU

ON_GPU = device() == "cuda"     # below: Triton, read once the interpreter is set

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from allspark_server.compute import row_mode  # noqa: E402
from allspark_server.compute.cuda import gemv_kernels as gk  # noqa: E402
from allspark_server.compute.cuda import pdl  # noqa: E402
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}


@triton.jit
def _row_acc(acc, wt, x, i, M, offs_k, K, stride_xm):
    xi = tl.load(x + tl.minimum(i, M - 1) * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return acc + wt * xi[None, :]


@triton.jit
def _row_store(acc, out, i, M, offs_n, n_ok, stride_om):
    if i < M:
        tl.store(out + i * stride_om + offs_n, tl.sum(acc, 1).to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def fma_rows_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        a0 = _row_acc(a0, wt, x, 0, M, offs_k, K, stride_xm)
        if ROWS > 1:
            a1 = _row_acc(a1, wt, x, 1, M, offs_k, K, stride_xm)
        if ROWS > 2:
            a2 = _row_acc(a2, wt, x, 2, M, offs_k, K, stride_xm)
        if ROWS > 3:
            a3 = _row_acc(a3, wt, x, 3, M, offs_k, K, stride_xm)
        if ROWS > 4:
            a4 = _row_acc(a4, wt, x, 4, M, offs_k, K, stride_xm)
        if ROWS > 5:
            a5 = _row_acc(a5, wt, x, 5, M, offs_k, K, stride_xm)
        if ROWS > 6:
            a6 = _row_acc(a6, wt, x, 6, M, offs_k, K, stride_xm)
        if ROWS > 7:
            a7 = _row_acc(a7, wt, x, 7, M, offs_k, K, stride_xm)
    _row_store(a0, out, 0, M, offs_n, n_ok, stride_om)
    if ROWS > 1:
        _row_store(a1, out, 1, M, offs_n, n_ok, stride_om)
    if ROWS > 2:
        _row_store(a2, out, 2, M, offs_n, n_ok, stride_om)
    if ROWS > 3:
        _row_store(a3, out, 3, M, offs_n, n_ok, stride_om)
    if ROWS > 4:
        _row_store(a4, out, 4, M, offs_n, n_ok, stride_om)
    if ROWS > 5:
        _row_store(a5, out, 5, M, offs_n, n_ok, stride_om)
    if ROWS > 6:
        _row_store(a6, out, 6, M, offs_n, n_ok, stride_om)
    if ROWS > 7:
        _row_store(a7, out, 7, M, offs_n, n_ok, stride_om)


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


def alone_gemv(x, w):
    with row_mode.alone_rows():
        return gk.gemv(x, w)


FMA_CONFIGS = [(2, 2048, 8), (2, 4096, 8), (1, 2048, 4), (1, 4096, 8), (2, 2048, 16), (4, 1024, 8), (1, 1024, 4)]
DOT_CONFIGS = [(32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 6), (32, 512, 4, 3), (16, 256, 4, 4),
               (128, 128, 8, 4), (16, 512, 4, 4), (32, 128, 4, 8)]


def exact_rows(fn, x) -> bool:
    y = fn(x)
    return all(torch.equal(y[i:i + 1], fn(x[i:i + 1])) for i in range(x.shape[0]))


TMA_CONFIGS = [(64, 128, 4, 6), (64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (64, 64, 4, 8),
               (32, 128, 4, 6), (128, 64, 4, 8), (64, 256, 4, 3)]
PDL_CONFIGS = [(64, 128, 4, 6), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4), (32, 128, 2, 6), (32, 256, 2, 4),
               (16, 256, 1, 4), (16, 128, 1, 6), (64, 64, 4, 8), (128, 64, 8, 6), (64, 128, 8, 6), (128, 128, 4, 4)]


def chain(gemv, layers, x):
    """A decode layer's four GEMVs in sequence, each reading the one before (8 layers)."""
    h = x
    for wqkv, wo, wgu, wd in layers:
        q = gemv(h, wqkv)[:, :4096]
        h = gemv(q, wo)
        g = gemv(h, wgu)[:, :11008]
        h = gemv(g, wd)
    return h


def pdl_round(args):
    from cuda_common import time_us
    result = {}
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16) for _ in range(copies_past_l2(n * k * 2))]
        row = result[name] = {}
        for m in args.rows:
            x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
            row[f"prod_{m}"] = per_call_us(lambda w: gk.gemv(x, w), ws) if m <= 2 else None
            row[f"prod_alone_{m}"] = per_call_us(lambda w: alone_gemv(x, w), ws)
            for cfg in TMA_CONFIGS:
                key = f"tma_{'_'.join(map(str, cfg))}_{m}"
                try:
                    row[key] = per_call_us(lambda w: dot_tma(x, w, *cfg), ws)
                    if m > 1:
                        row[key + "_exact"] = exact_rows(lambda t: dot_tma(t, ws[0], *cfg), x)
                        row[key + "_same_as_pdl"] = torch.equal(dot_tma(x, ws[0], *cfg), dot_pdl(x, ws[0], *cfg))
                except Exception as e:  # noqa: BLE001
                    row[key] = repr(e)[:300]
            for cfg in PDL_CONFIGS[:2] if args.tma_only else PDL_CONFIGS:
                key = f"pdl_{'_'.join(map(str, cfg))}_{m}"
                try:
                    row[key] = per_call_us(lambda w: dot_pdl(x, w, *cfg), ws)
                    if m > 1:
                        row[key + "_exact"] = exact_rows(lambda t: dot_pdl(t, ws[0], *cfg), x)
                except Exception as e:  # noqa: BLE001
                    row[key] = repr(e)[:200]
        print(name, json.dumps(row), flush=True)
        ws = None  # noqa: F841 (the copies freed before the next shape's)
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [tuple((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                    for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))) for _ in range(8)]
    ch = result["chain8"] = {}
    for m in args.rows:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        if m <= 2:
            ch[f"prod_{m}"] = time_us(lambda: chain(gk.gemv, layers, x))
        ch[f"prod_alone_{m}"] = time_us(lambda: chain(alone_gemv, layers, x))
        for cfg in TMA_CONFIGS[:6]:
            ch[f"tma_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                lambda: chain(lambda a, w: dot_tma(a, w, *cfg), layers, x))
        for cfg in PDL_CONFIGS[:1]:
            ch[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                lambda: chain(lambda a, w: dot_pdl(a, w, *cfg), layers, x))
    print("chain8", json.dumps(ch), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="exact_rows_micro.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--pdl-round", action="store_true")
    ap.add_argument("--tma-only", action="store_true")
    args = ap.parse_args(argv)
    if args.pdl_round:
        return pdl_round(args)
    shapes = {"qkv": (64, 256), "down": (32, 320)} if args.smoke else SHAPES
    fma_cfgs = FMA_CONFIGS[:2] if args.smoke else FMA_CONFIGS
    dot_cfgs = [(16, 64, 4, 2)] if args.smoke else DOT_CONFIGS
    result = {}
    for name, (n, k) in shapes.items():
        ws = ([(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16)] if args.smoke else
              [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16)
               for _ in range(copies_past_l2(n * k * 2))])
        row = result[name] = {"gb": n * k * 2 / 1e9}
        for m in args.rows:
            x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
            ref = F.linear(x.double(), ws[0].double())
            def err(y):
                return ((y.double() - ref).abs().max() / ref.abs().max()).item()
            row[f"cublas_{m}"] = per_call_us(lambda w: F.linear(x, w), ws)
            row[f"prod_{m}"] = per_call_us(lambda w: gk.gemv(x, w), ws) if m <= 2 else None
            row[f"prod_alone_{m}"] = per_call_us(lambda w: alone_gemv(x, w), ws)
            for cfg in fma_cfgs:
                key = f"fma_{'_'.join(map(str, cfg))}_{m}"
                try:
                    row[key] = per_call_us(lambda w: fma_rows(x, w, *cfg), ws)
                    row[key + "_err"] = err(fma_rows(x, ws[0], *cfg))
                    if m > 1:
                        row[key + "_exact"] = exact_rows(lambda t: fma_rows(t, ws[0], *cfg), x)
                except Exception as e:  # noqa: BLE001 (a config that does not compile: recorded)
                    row[key] = repr(e)[:200]
            for cfg in dot_cfgs:
                for evict in (True, False):
                    key = f"dot_{'_'.join(map(str, cfg))}{'' if evict else '_noev'}_{m}"
                    try:
                        row[key] = per_call_us(lambda w: dot_rows(x, w, *cfg, evict), ws)
                        row[key + "_err"] = err(dot_rows(x, ws[0], *cfg, evict))
                        if m > 1:
                            row[key + "_exact"] = exact_rows(lambda t: dot_rows(t, ws[0], *cfg, evict), x)
                    except Exception as e:  # noqa: BLE001
                        row[key] = repr(e)[:200]
        print(name, json.dumps(row), flush=True)
        ws = None  # noqa: F841 (the copies freed before the next shape's)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__" and "--small" not in __import__("sys").argv:
    main()


SMALL_CONFIGS = [(32, 128, 2, 6), (16, 64, 1, 4), (16, 128, 1, 4), (16, 256, 1, 2), (16, 512, 2, 2), (32, 256, 2, 3),
                 (32, 512, 2, 2), (32, 1024, 4, 1), (16, 1024, 4, 1), (64, 128, 4, 6), (32, 64, 2, 4), (16, 128, 2, 3),
                 (16, 256, 2, 2), (32, 256, 4, 2)]


def small_chain(gemv, layers, x):
    """SmolLM2's four GEMVs a layer in sequence, each reading the one before (30 layers)."""
    h = x
    for wqkv, wo, wgu, wd in layers:
        h = gemv(gemv(h, wqkv)[:, :576], wo)
        h = gemv(gemv(h, wgu)[:, :1536], wd)
    return h


def small_round(out):
    from cuda_common import time_us
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [tuple((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))) for _ in range(30)]
    res = {}
    for m in (1, 5):
        x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
        if m == 1:
            res["prod_1"] = time_us(lambda: small_chain(gk.gemv, layers, x))
        res[f"prod_alone_{m}"] = time_us(lambda: small_chain(alone_gemv, layers, x))
        for cfg in SMALL_CONFIGS:
            try:
                res[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                    lambda: small_chain(lambda a, w: dot_pdl(a, w, *cfg), layers, x))
            except Exception as e:  # noqa: BLE001
                res[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = repr(e)[:200]
    w = (torch.randn(49152, 576, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    res["lm_prod_1"] = time_us(lambda: gk.gemv(x, w))
    for cfg in SMALL_CONFIGS:
        try:
            res[f"lm_pdl_{'_'.join(map(str, cfg))}_1"] = time_us(lambda: dot_pdl(x, w, *cfg))
        except Exception as e:  # noqa: BLE001
            res[f"lm_pdl_{'_'.join(map(str, cfg))}_1"] = repr(e)[:200]
    print(json.dumps(res))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__" and len(__import__("sys").argv) > 1 and __import__("sys").argv[1] == "--small":
    small_round(__import__("sys").argv[2])
