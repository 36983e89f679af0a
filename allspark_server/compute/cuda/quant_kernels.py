"""Triton matmul with InstantQuant weights (quant/formats.py) for GPU ranks: y = x @ dequantize(w).T, one
launch, the weight read once as codes (int8 / uint8 bytes, or two 4-bit codes a byte) and never written out
dequantized.

Each program owns a [BLOCK_M, BLOCK_N] tile of y. Per k-tile it loads the codes, subtracts the zero point
(int4: 8; uint8/uint4: the group's), which leaves small integers that bf16 and fp16 hold exactly, multiplies x
by them on the tensor cores with fp32 sums, and scales the partial by the group's fp16 scale (uint4_min, whose
w = code * scale + min and whose `zeros` argument holds the fp16 mins: the codes as they are, plus the group's min
times x summed over the k-tile, that sum one more dot of the tile against ones so that it lands in the
accumulator's layout: at 16 rows 1.05x uint4's time in groups of 32 where sums reduced in registers took 1.19x): the
reference's products, summed in another order (agreement within fp32 rounding of the dequantize-then-matmul reference,
`ops.linear` on a GPU quantized weight's codes). A k-tile never straddles a group (BLOCK_K divides the group
size). 4-bit bytes hold k = j and k = 16 + j of each 32-block (the packing of quant/formats.py), so a tile
of bytes is two dots: the low nibbles against x's columns j, the high ones against j + 16.

Three paths by the rows of x: up to GEMV_MAX_ROWS (batch-1 decode) a GEMV that dequantizes in registers and
uses FMAs; up to DOT_MAX_ROWS tensor-core tiles as above; more rows (prefill) dequantize the weight into x's
dtype (one Triton pass) for cuBLAS's GEMM. The first two split K over several programs per output tile when
the output tiles alone would leave SMs idle; their fp32 partials are summed in a fixed order (deterministic,
CUDA-graph safe: nothing is read on the host); unsplit, the kernel stores y in x's dtype itself. The GEMV and
the dequantize kernels are in quant_gemv.py; this module holds the tensor-core kernel, the launch configs and
the host side that picks a path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.quant_gemv import FMT_FP8, dequantize_kernel, quant_gemv_kernel
from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight, bits, has_mins, is_float

INT8, UINT8, INT4, UINT4, UINT4_MIN = (FORMAT_IDS[f] for f in ("int8", "uint8", "int4", "uint4", "uint4_min"))
assert FORMAT_IDS["fp8_e4m3"] == FMT_FP8.value


@triton.jit
def _codes_dot(xt, codes, zero, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """x [BLOCK_M, KT] (a loaded tile) @ (codes - zero) [KT, BLOCK_N], fp32 sums."""
    if UPCAST:   # the interpreter: its bf16 dot multiplies raw bits, so fp32 operands (the same values)
        return tl.dot(xt.to(tl.float32), (codes - zero).to(tl.float32), input_precision="ieee")
    return tl.dot(xt.to(DOT_DTYPE), (codes - zero).to(DOT_DTYPE), input_precision="ieee")


@triton.jit
def _quant_matmul_kernel(x, qw, scales, zeros, out, M, N, K, k_per_split,
                         stride_xm, stride_qn, stride_sn, stride_zn, stride_os, stride_om,
                         FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
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
        if FMT <= 1 or FMT == FMT_FP8:     # 8-bit codes [BK, BN]
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            codes = tl.load(q_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            xt = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if FMT == FMT_FP8:  # e4m3 values: exact in bf16 and fp16 (3 mantissa bits, exponents 2^-9 .. 2^8)
                part = _codes_dot(xt, codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), 0, DOT_DTYPE, UPCAST)
            else:
                part = _codes_dot(xt, codes.to(tl.int32), zero, DOT_DTYPE, UPCAST)
        else:            # bytes [BK/2, BN]: low nibble k = 32 b + j, high nibble k + 16
            p = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (p // 16) * 32 + p % 16
            p_ok = k_lo < k_end      # a per-channel K's last tile may be partial (K is a multiple of 32)
            byte = tl.load(q_cols + (k0 // 2 + p)[:, None], mask=p_ok[:, None] & n_ok[None, :], other=0)
            byte = byte.to(tl.int32)
            x_mask = m_ok[:, None] & p_ok[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            part = _codes_dot(x_lo, byte & 15, zero, DOT_DTYPE, UPCAST)
            part += _codes_dot(x_hi, (byte >> 4) & 15, zero, DOT_DTYPE, UPCAST)
            if HAS_MIN:   # + min * (sum of x over the tile): [BM, BN], every column the sum
                mn = tl.load(zeros + offs_n * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)       # [BN]
                ones = tl.full((BLOCK_K // 2, BLOCK_N), 1, tl.int32)
                x_sum = _codes_dot(x_lo, ones, 0, DOT_DTYPE, UPCAST) + _codes_dot(x_hi, ones, 0, DOT_DTYPE, UPCAST)
                acc += x_sum * mn[None, :]
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
    eviction: str = ""        # the GEMV's loads of codes: "" (normal) or "evict_first"
    rows_alone: bool = False  # the one-row GEMV, a program per row of x and tile (alone_config)


SM_COUNT_DEFAULT = 132          # H100 / H200; read from the device when there is one
GEMV_MAX_ROWS = 2               # up to this many rows: the FMA kernel; more: tensor-core tiles
DOT_MAX_ROWS = 64               # above this many rows: dequantize into x's dtype and take cuBLAS's GEMM
MIN_PROGRAMS_PER_SM = 4         # split K until a small-M launch has about this many programs per SM
FP8_WIDE_CODES = 32 << 20       # fp8 weights of this many codes or more: the GEMV's wide programs


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SM_COUNT_DEFAULT


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device, fmt: str = "int8",
                  silu_mul: bool = False) -> LaunchConfig:
    """Tile shapes by rows of x: the FMA GEMV (m <= GEMV_MAX_ROWS) or tensor-core tiles (m <= DOT_MAX_ROWS);
    K split until there are about MIN_PROGRAMS_PER_SM programs per SM. `group_size` as QuantizedWeight's (-1:
    per channel); `n` the output columns (silu_mul: of the activation, each a gate and an up row of the weight).
    Defaults from sweeps on an H100, fp8's on an H200 (benchmarks/cuda_quant_micro.py --sweep)."""
    eviction = ""
    if m <= GEMV_MAX_ROWS and group_size == -1 and is_float(fmt):
        # fp8's sweep: 8 rows x 4096 codes a program on weights of FP8_WIDE_CODES or more, else 4 x 2048 (silu_mul
        # loads a gate and an up row for each column: half as many columns)
        wide = n * k * (2 if silu_mul else 1) >= FP8_WIDE_CODES
        block_m, warps, stages, eviction = triton.next_power_of_2(m), 4, 1, "evict_first"
        block_n, block_k = (8, 4096) if wide else (4, 2048)
        block_n, block_k = block_n // (2 if silu_mul else 1), min(block_k, triton.next_power_of_2(k))
    elif m <= GEMV_MAX_ROWS and group_size == -1:
        # per channel: 2 rows x up to 4096 codes a program, streamed once (int8's sweep: 3-4% faster than 4 x 2048)
        block_m, block_n, warps, stages = triton.next_power_of_2(m), 2, 4, 1
        block_k, eviction = min(4096, triton.next_power_of_2(k)), "evict_first"
    elif m <= GEMV_MAX_ROWS:   # sweeps: thin tiles, long K runs, no split (4 rows x 2048 codes a program)
        block_m, block_n, block_k, warps, stages = triton.next_power_of_2(m), 4, 2048, 4, 1
    elif m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 32, 128, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 64, 64, 128, 4, 3
    if group_size != -1 and m > GEMV_MAX_ROWS:   # a tensor-core k-tile lies inside one group (powers of two)
        block_k = min(block_k, group_size)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = triton.cdiv(k, block_k)
    want = MIN_PROGRAMS_PER_SM * _sm_count(device)
    split = max(1, min(k_tiles // 2, -(-want // max(tiles, 1))))
    return LaunchConfig(block_m, block_n, block_k, split, warps, stages, eviction)


def alone_config(n: int, k: int, group_size: int, device: torch.device, fmt: str = "int8",
                 silu_mul: bool = False) -> LaunchConfig:
    """The one-row GEMV's config (its tiles, its K split) for any rows of x in one launch, a program per row and
    tile: each row meets the same codes in the same order as alone, so its result is the one-row launch's bit for
    bit, and neighbouring programs read a tile's codes from memory once for all rows (compute/row_mode.py: a
    speculative verify chunk's rows)."""
    return dataclasses.replace(choose_config(1, n, k, group_size, device, fmt, silu_mul), rows_alone=True)


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dequantize(w: QuantizedWeight, dtype: torch.dtype, block_n: int = 32, block_k: int = 256) -> torch.Tensor:
    """The weight [N, K] the codes stand for, in `dtype` (one rounding of (code - zero) * scale; uint4_min: of
    code * scale + min, the product rounded to fp32 first as the reference does: no fused multiply-add)."""
    n, k = w.out_features, w.in_features
    group = k if w.group_size == -1 else w.group_size
    if w.group_size != -1:
        block_k = min(block_k, group)
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    zeros, has_min = w.zeros, has_mins(w.fmt)
    no_fma = {"enable_fp_fusion": False} if has_min and not _INTERPRETED else {}
    dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.qweight, w.scales, w.scales if zeros is None else zeros, out, n, k, w.qweight.stride(0),
        w.scales.stride(0), 0 if zeros is None else zeros.stride(0), out.stride(0),
        FMT=FORMAT_IDS[w.fmt], GROUP=group, HAS_ZERO=zeros is not None and not has_min, HAS_MIN=has_min,
        BLOCK_N=block_n, BLOCK_K=block_k, **no_fma)
    return out


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                 config: LaunchConfig | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16, unit stride along K) @ the dequantized w [N, K].T (+ bias) -> [M, N] in
    x's dtype (fp32 sums, one rounding). More than DOT_MAX_ROWS rows (prefill) without a config: the weight
    dequantized into x's dtype for cuBLAS. silu_mul (the GEMV's rows, no bias): w is the merged gate_up [2I, K]
    and the result ops.silu_mul of the product, [M, I], from one launch (`fits_silu_mul`)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] == w.in_features, (x.shape, w.in_features)
    m, k = x.shape
    n = w.out_features // 2 if silu_mul else w.out_features
    if config is None and m > DOT_MAX_ROWS:
        return torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
    group = k if w.group_size == -1 else w.group_size
    cfg = config or choose_config(m, n, k, w.group_size, x.device, w.fmt, silu_mul)
    if silu_mul:     # the epilogue needs whole sums: one split
        assert bias is None and (m <= GEMV_MAX_ROWS or cfg.rows_alone) and w.out_features % 2 == 0, \
            (bias is None, m, w.out_features)
        cfg = dataclasses.replace(cfg, split_k=1)
    fmt = FORMAT_IDS[w.fmt]
    gemv = cfg.block_m <= GEMV_MAX_ROWS
    assert not gemv or m <= cfg.block_m or cfg.rows_alone, (m, cfg)
    assert w.group_size == -1 or group % cfg.block_k == 0 or (gemv and cfg.block_k % group == 0), (group, cfg)
    assert bits(w.fmt) == 8 or cfg.block_k % 32 == 0, cfg.block_k
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1 and bias is None:      # the kernel writes y itself (its store rounds once into x's dtype)
        partial = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)       # [S, M, N]
    zeros = w.zeros
    grid_rows = m if cfg.rows_alone else 1            # rows_alone: a program a row, each with M = 1 as alone
    args = (x, w.qweight, w.scales, w.scales if zeros is None else zeros, partial, m // grid_rows, n, k, k_per_split,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), 0 if zeros is None else zeros.stride(0),
            partial.stride(0), partial.stride(1))
    common = dict(FMT=fmt, GROUP=group, HAS_ZERO=zeros is not None and fmt != UINT4_MIN, HAS_MIN=fmt == UINT4_MIN,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if gemv:
        sub = cfg.block_k if w.group_size == -1 else min(cfg.block_k, w.group_size)
        # uint4_min: the min in the weights where a program has one k-tile, else min * sum(x) (quant_gemv.py)
        common["HAS_MIN"] = 0 if fmt != UINT4_MIN else 2 if k_per_split <= cfg.block_k else 1
        quant_gemv_kernel[(triton.cdiv(n, cfg.block_n) * grid_rows, splits)](
            *args, up_rows=n, grid_rows=grid_rows, BLOCK_M=cfg.block_m, SUB=sub, EVICTION=cfg.eviction,
            SILU_MUL=silu_mul, SOFT_BF16=_INTERPRETED, **common, **pdl.launch_options(x.device))
    else:
        _quant_matmul_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)](
            *args, BLOCK_M=cfg.block_m, DOT_DTYPE=_DOT_DTYPES[x.dtype],
            UPCAST=_INTERPRETED and x.dtype != torch.float32, num_stages=cfg.num_stages, **common)
    y = partial[0] if splits == 1 else partial.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


_INTERPRETED = not isinstance(_quant_matmul_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
