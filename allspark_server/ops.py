"""Compute ops with a native fast path: the only importer of the native extension (native/*.cpp).

Each op has a torch reference (`*_reference`) that the native kernel is tested against and that
runs whenever the extension is unavailable or the shape does not suit it. The ISA level the
kernels use is read once from py-cpuinfo (AVX-512 > AVX2+FMA > portable); ALLSPARK_NO_NATIVE=1
turns the native path off.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = 0, 1, 2
# largest number of rows of x the native linear takes; above it GEMM libraries win (measured:
# benchmarks/bench_kernels.py); bf16 weights lean on oneDNN's bf16 dot products sooner.
NATIVE_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 4}


@functools.lru_cache(maxsize=1)
def native():
    """The extension module, or None (not built, or disabled)."""
    if os.environ.get("ALLSPARK_NO_NATIVE") == "1":
        return None
    try:
        from allspark_server import _native
    except ImportError as e:
        log.warning("native kernels unavailable (%s); using the PyTorch path", e)
        return None
    return _native


@functools.lru_cache(maxsize=1)
def isa_level() -> int:
    try:
        import cpuinfo
        flags = set(cpuinfo.get_cpu_info().get("flags", []))
    except Exception:
        return ISA_PORTABLE
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return ISA_AVX512
    if {"avx2", "fma"} <= flags:
        return ISA_AVX2
    return ISA_PORTABLE


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias), x [M, K], w [N, K]; the native kernel streams w for small M."""
    ext = native()
    if (ext is None or x.dim() != 2 or x.shape[0] > NATIVE_MAX_ROWS.get(w.dtype, 0)
            or x.dtype != w.dtype or not w.is_contiguous()):
        return F.linear(x, w, bias)
    y = ext.linear_small_m(x, w, isa_level())          # fp32 [M, N]
    if bias is not None:
        y += bias
    return y.to(x.dtype)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                               ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence: q [B, H, D], caches [S, P, KVH, D], spans [B, MAXS], ctx [B] -> [B, H, D]."""
    _, span_size, kvh, d = k_cache.shape
    out = torch.empty_like(q)
    offsets = torch.arange(span_size)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        slots = (spans[b, :-(-n // span_size)][:, None] * span_size + offsets).reshape(-1)[:n]
        k = k_cache.view(-1, kvh, d)[slots].transpose(0, 1)[None]          # [1, KVH, n, D]
        v = v_cache.view(-1, kvh, d)[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=scale, enable_gqa=kvh != q.shape[1])
        out[b] = o[0, :, 0]
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                     ctx: torch.Tensor, scale: float) -> torch.Tensor:
    ext = native()
    if ext is None or q.dtype not in (torch.float32, torch.bfloat16):
        return decode_attention_reference(q, k_cache, v_cache, spans, ctx, scale)
    return ext.decode_attention(q, k_cache, v_cache, spans, ctx, scale, isa_level())
