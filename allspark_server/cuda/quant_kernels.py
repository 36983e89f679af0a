"""Triton matmul with InstantQuant weights (quant/formats.py) for GPU ranks: y = x @ dequantize(w).T, one
launch, the weight read once as codes (int8 / uint8 bytes, or two 4-bit codes a byte) and never written out
dequantized.

Each program owns a [BLOCK_M, BLOCK_N] tile of y. Per k-tile it loads the codes, subtracts the zero point
(int4: 8; uint8/uint4: the group's), which leaves small integers that bf16 and fp16 hold exactly, multiplies x
by them on the tensor cores with fp32 sums, and scales the partial by the group's fp16 scale: the reference's
products, summed in another order (agreement within fp32 rounding of the dequantize-then-matmul reference,
`ops.linear` on a GPU quantized weight's codes). A k-tile never straddles a group (BLOCK_K divides the group
size). 4-bit bytes hold k = j and k = 16 + j of each 32-block (the packing of quant/formats.py), so a tile
of bytes is two dots: the low nibbles against x's columns j, the high ones against j + 16.

Small M (decode) splits K over SPLIT_K programs per tile so that a GEMV keeps every SM streaming; their fp32
partials are summed in a fixed order (deterministic, CUDA-graph safe: nothing is read on the host).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight

INT8, UINT8, INT4, UINT4 = (FORMAT_IDS[f] for f in ("int8", "uint8", "int4", "uint4"))


@triton.jit
def _codes_dot(x_ptrs, x_mask, codes, zero, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """x [BLOCK_M, KT] (loaded through x_ptrs) @ (codes - zero) [KT, BLOCK_N], fp32 sums."""
    xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if UPCAST:   # the interpreter: its bf16 dot multiplies raw bits, so fp32 operands (the same values)
        return tl.dot(xt.to(tl.float32), (codes - zero).to(tl.float32), input_precision="ieee")
    return tl.dot(xt.to(DOT_DTYPE), (codes - zero).to(DOT_DTYPE), input_precision="ieee")


@triton.jit
def _quant_matmul_kernel(x, qw, scales, zeros, out, M, N, K, k_per_split,
                         stride_xm, stride_qn, stride_sn, stride_zn, stride_os, stride_om,
                         FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (n tile, m tile, k split) -> fp32 partial out[split, m tile, n tile]; K range
    [split * k_per_split, min(K, (split + 1) * k_per_split)), k_per_split a multiple of BLOCK_K."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm                                 # [BM, 1]
    q_cols = qw + offs_n.to(tl.int64)[None, :] * stride_qn                                # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        g = k0 // GROUP
        scale = tl.load(scales + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)   # [BN]
        if HAS_ZERO:
            zero = tl.load(zeros + offs_n * stride_zn + g, mask=n_ok, other=0).to(tl.int32)[None, :]
        elif FMT == 2:   # int4: codes stored offset by 8
            zero = 8
        else:
            zero = 0
        if FMT <= 1:     # 8-bit codes [BK, BN]
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            codes = tl.load(q_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            part = _codes_dot(x_rows + offs_k[None, :], m_ok[:, None] & k_ok[None, :], codes.to(tl.int32), zero,
                              DOT_DTYPE, UPCAST)
        else:            # bytes [BK/2, BN]: low nibble k = 32 b + j, high nibble k + 16
            p = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (p // 16) * 32 + p % 16
            p_ok = k_lo < k_end      # a per-channel K's last tile may be partial (K is a multiple of 32)
            byte = tl.load(q_cols + (k0 // 2 + p)[:, None], mask=p_ok[:, None] & n_ok[None, :], other=0)
            byte = byte.to(tl.int32)
            x_mask = m_ok[:, None] & p_ok[None, :]
            part = _codes_dot(x_rows + k_lo[None, :], x_mask, byte & 15, zero, DOT_DTYPE, UPCAST)
            part += _codes_dot(x_rows + (k_lo + 16)[None, :], x_mask, (byte >> 4) & 15, zero, DOT_DTYPE, UPCAST)
        acc += part * scale[None, :]
    dst = out + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


SM_COUNT_DEFAULT = 132          # H100 / H200; read from the device when there is one
GEMV_TARGET_WAVES = 2           # small M: split K until about this many programs per SM


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SM_COUNT_DEFAULT


def choose_config(m: int, n: int, k: int, group: int, device: torch.device) -> LaunchConfig:
    """Tile shapes by rows of x (decode rows vs a prefill chunk); small M gets split-K so that a GEMV has
    about GEMV_TARGET_WAVES programs per SM."""
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 256, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 128, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    if group != k:        # grouped: a k-tile lies inside one group (group sizes are powers of two >= 32)
        block_k = min(block_k, group)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    if m <= 64:
        want = GEMV_TARGET_WAVES * _sm_count(device)
        k_tiles = triton.cdiv(k, block_k)
        split = max(1, min(k_tiles // 4, want // max(tiles, 1)))
    return LaunchConfig(block_m, block_n, block_k, split, warps, stages)


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                 config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16, unit stride along K) @ the dequantized w [N, K].T (+ bias) -> [M, N] in
    x's dtype (fp32 sums, one rounding)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] == w.in_features, (x.shape, w.in_features)
    m, k = x.shape
    n = w.out_features
    group = k if w.group_size == -1 else w.group_size
    cfg = config or choose_config(m, n, k, group, x.device)
    fmt = FORMAT_IDS[w.fmt]
    assert w.group_size == -1 or group % cfg.block_k == 0, (group, cfg.block_k)
    assert fmt < INT4 or cfg.block_k % 32 == 0, cfg.block_k
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)           # [S, M, N]
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    zeros = w.zeros
    _quant_matmul_kernel[grid](
        x, w.qweight, w.scales, w.scales if zeros is None else zeros, partial, m, n, k, k_per_split,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), 0 if zeros is None else zeros.stride(0),
        partial.stride(0), partial.stride(1),
        FMT=fmt, GROUP=group, HAS_ZERO=zeros is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_DTYPE=_DOT_DTYPES[x.dtype], UPCAST=_INTERPRETED and x.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = partial[0] if splits == 1 else partial.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


_INTERPRETED = not isinstance(_quant_matmul_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
