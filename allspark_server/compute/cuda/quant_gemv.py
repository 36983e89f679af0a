"""The FMA side of the InstantQuant matmul, launched by quant_kernels.py: the GEMV of a row or two of x (decode),
which streams the codes with K contiguous and meets each row of x with FMAs (optionally silu(gate) * up in its
epilogue), and the dequantize of a weight into x's dtype for prefill's cuBLAS GEMM. Both turn codes into floats in
registers by the exponent trick (`_code_values`). uint4_min (`zeros` then points at its fp16 mins), the GEMV's
HAS_MIN: 1 adds min * (x summed over the group) to each group's scaled sum, a second reduction, which the weight
stream hides when a program has several k-tiles (8192 x 8192 on an H100: 0.99x uint4's time) but not when it has one
(2048 x 2048: 1.43x); 2 (one k-tile a program) turns the codes into the weights, code * scale + min, one FMA each and
no scale after (2048 x 2048: 1.01x; 8192 x 8192: 1.11x). fp8_e4m3's bytes (FMT_FP8) become floats by the
hardware's e4m3 conversion instead, with no zero point."""
from __future__ import annotations

import triton
import triton.language as tl

from allspark_server.compute.cuda.fused_kernels import _round, _silu_mul_rounded
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous

FMT_FP8 = tl.constexpr(5)      # formats.FORMAT_IDS["fp8_e4m3"]: byte codes that are e4m3 floats


@triton.jit
def _code_values(bits, zero, FMT: tl.constexpr):
    """Unsigned codes (int32, 0..255 or 0..15) -> code - zero in fp32 by the exponent trick: OR-ing a code into
    the mantissa of 2^23 gives the float 2^23 + code, so one integer op and one exact subtraction replace a
    (quarter-rate) int-to-float conversion. int8's bytes are two's complement: XOR 0x80 makes them code + 128.
    fp8_e4m3's bytes (uint8, as _code_tile leaves them) are the values themselves."""
    if FMT == FMT_FP8:
        values = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FMT == 0:
        values = (bits ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0       # 2^23 + 128
    else:
        values = (bits | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)
    return values


@triton.jit
def _code_tile(qw, rows, n_ok, k0, k_end, stride_qn, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVICTION: tl.constexpr):
    """The codes of the k-tile [k0, k0 + BLOCK_K) of weight rows `rows` [BLOCK_N] as int32: [BN, BK] bytes for
    8-bit codes, [BN, BK / 2] for 4-bit (two codes a byte), 0 where masked; fp8's bytes as uint8."""
    q_rows = qw.to(tl.pointer_type(tl.uint8), bitcast=True) + rows.to(tl.int64)[:, None] * stride_qn  # [BN, 1]
    if FMT <= 1 or FMT == FMT_FP8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        bits = tl.load(q_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < k_end)[None, :], other=0,
                       eviction_policy=EVICTION)
    else:
        p = tl.arange(0, BLOCK_K // 2)
        p_ok = k0 + (p // 16) * 32 + p % 16 < k_end
        bits = tl.load(q_rows + (k0 // 2 + p)[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0,
                       eviction_policy=EVICTION)
    if FMT != FMT_FP8:
        bits = bits.to(tl.int32)
    return bits


@triton.jit
def _gemv_tile(acc, bits, x, scales, zeros, rows, n_ok, offs_m, k0, k_end, M,
               stride_xm, stride_sn, stride_zn,
               FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] plus the k-tile [k0, k0 + BLOCK_K) of weight rows `rows` [BLOCK_N], whose codes
    `bits` _code_tile loaded, met by each row of x: per sub-tile of one group, sum_k (code - zero) * x times its
    scale (uint4_min, HAS_MIN 1: plus its min times sum_k x; 2: sum_k (code * scale + min) * x)."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    offs_g = k0 // GROUP + tl.arange(0, NSUB)
    g_ok = n_ok[:, None] & (offs_g * GROUP < k_end)[None, :]
    scale = tl.load(scales + rows[:, None] * stride_sn + offs_g[None, :], mask=g_ok, other=0.0)
    scale = scale.to(tl.float32)                                                         # [BN, NSUB]
    if HAS_ZERO:
        zero = tl.load(zeros + rows[:, None] * stride_zn + offs_g[None, :], mask=g_ok, other=0)
        zero = zero.to(tl.float32)                                                       # [BN, NSUB]
    elif FMT == 2:
        zero = 8.0
    else:
        zero = 0.0
    if HAS_MIN:
        mn = tl.load(zeros + rows[:, None] * stride_zn + offs_g[None, :], mask=g_ok, other=0.0).to(tl.float32)
    if NSUB == 1:   # one group (or the row's one scale) per k-tile: plain [BN, K] tiles
        scale = tl.reshape(scale, (BLOCK_N,))
        if HAS_ZERO:
            zero = tl.reshape(zero, (BLOCK_N, 1))
        if HAS_MIN:
            mn = tl.reshape(mn, (BLOCK_N,))
    elif HAS_ZERO:
        zero = zero[:, :, None]
    if FMT <= 1 or FMT == FMT_FP8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        if NSUB == 1:
            w = _code_values(bits, zero, FMT)                                            # [BN, BK]
        else:
            w = _code_values(tl.reshape(bits, (BLOCK_N, NSUB, SUB)), zero, FMT)         # [BN, NSUB, SUB]
        for i in tl.static_range(BLOCK_M):
            xi = tl.load(x + tl.minimum(i, M - 1) * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if NSUB == 1:
                part = tl.sum(w * xi[None, :], 1) * scale
            else:
                part = tl.sum(tl.sum(w * tl.reshape(xi, (1, NSUB, SUB)), 2) * scale, 1)          # [BN]
            acc = tl.where(offs_m[:, None] == i, acc + part[None, :], acc)
    else:            # bytes [BN, BK/2]: low nibble k = 32 b + j, high nibble k + 16
        p = tl.arange(0, BLOCK_K // 2)
        k_lo = k0 + (p // 16) * 32 + p % 16
        p_ok = k_lo < k_end
        byte = bits
        if NSUB != 1:
            byte = tl.reshape(byte, (BLOCK_N, NSUB, SUB // 2))     # a group's bytes are contiguous
        if HAS_MIN == 2:   # the weights: code * scale + min
            s3, m3 = (scale[:, None], mn[:, None]) if NSUB == 1 else (scale[:, :, None], mn[:, :, None])
            w_lo = _code_values(byte & 15, zero, FMT) * s3 + m3
            w_hi = _code_values(byte >> 4, zero, FMT) * s3 + m3
        else:
            w_lo = _code_values(byte & 15, zero, FMT)
            w_hi = _code_values(byte >> 4, zero, FMT)
        for i in tl.static_range(BLOCK_M):
            x_row = x + tl.minimum(i, M - 1) * stride_xm      # rows past M repeat the last (not stored)
            x_lo = tl.load(x_row + k_lo, mask=p_ok, other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + k_lo + 16, mask=p_ok, other=0.0).to(tl.float32)
            if NSUB == 1:
                part = tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], 1)
                if HAS_MIN == 1:
                    part = part * scale + mn * (tl.sum(x_lo, 0) + tl.sum(x_hi, 0))
                elif HAS_MIN == 0:
                    part = part * scale
            else:
                part = tl.sum(w_lo * tl.reshape(x_lo, (1, NSUB, SUB // 2))
                              + w_hi * tl.reshape(x_hi, (1, NSUB, SUB // 2)), 2)
                if HAS_MIN == 1:   # each group's sum of x [1, NSUB], in the products' layout
                    part = part * scale + mn * tl.sum(tl.reshape(x_lo, (1, NSUB, SUB // 2))
                                                      + tl.reshape(x_hi, (1, NSUB, SUB // 2)), 2)
                elif HAS_MIN == 0:
                    part = part * scale
                part = tl.sum(part, 1)
            acc = tl.where(offs_m[:, None] == i, acc + part[None, :], acc)
    return acc


@triton.jit
def _code_tiles(qw, rows, up_rows, n_ok, k0, k_end, stride_qn, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU_MUL: tl.constexpr, EVICTION: tl.constexpr):
    """_code_tile of the rows and, with SILU_MUL, of the up rows (the second is the first otherwise)."""
    bits = _code_tile(qw, rows, n_ok, k0, k_end, stride_qn, FMT, BLOCK_K, EVICTION)
    bits_up = bits
    if SILU_MUL:
        bits_up = _code_tile(qw, up_rows, n_ok, k0, k_end, stride_qn, FMT, BLOCK_K, EVICTION)
    return bits, bits_up


@triton.jit
def _gemv_tiles(acc, acc_up, bits, bits_up, k0, x, scales, zeros, rows, up_rows, n_ok, offs_m, k_end, M,
                stride_xm, stride_sn, stride_zn, FMT: tl.constexpr, GROUP: tl.constexpr,
                HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SUB: tl.constexpr, SILU_MUL: tl.constexpr):
    """_gemv_tile of the rows' codes and, with SILU_MUL, of the up rows' into acc_up."""
    acc = _gemv_tile(acc, bits, x, scales, zeros, rows, n_ok, offs_m, k0, k_end, M, stride_xm, stride_sn,
                     stride_zn, FMT, GROUP, HAS_ZERO, HAS_MIN, BLOCK_M, BLOCK_N, BLOCK_K, SUB)
    if SILU_MUL:
        acc_up = _gemv_tile(acc_up, bits_up, x, scales, zeros, up_rows, n_ok, offs_m, k0, k_end, M, stride_xm,
                            stride_sn, stride_zn, FMT, GROUP, HAS_ZERO, HAS_MIN, BLOCK_M, BLOCK_N, BLOCK_K, SUB)
    return acc, acc_up


@triton.jit(do_not_specialize=["grid_rows"])
def quant_gemv_kernel(x, qw, scales, zeros, out, M, N, K, k_per_split,
                      stride_xm, stride_qn, stride_sn, stride_zn, stride_os, stride_om, up_rows, grid_rows,
                      FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                      EVICTION: tl.constexpr, SILU_MUL: tl.constexpr, SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """A row or two of x (decode): program (n tile, k split) streams its [BLOCK_N, K-range] codes with K
    contiguous and meets each row of x with FMAs (no tensor cores: at a row or two the weight's bytes are the
    whole cost). A k-tile is BLOCK_K // SUB sub-tiles of one group each (SUB = min(BLOCK_K, group)) ->
    out[split, :M, n tile] (fp32 partials, or y itself in its dtype). EVICTION: the codes' cache policy
    ("evict_first": streamed once). SILU_MUL (one split): rows n and up_rows + n are the merged gate_up's gate
    and up rows, and out = silu(gate) * up in x's dtype, rounded as ops.silu_mul rounds the linear's output.
    PDL (pdl.py): the first k-tile's codes are loaded before waiting for the kernel that writes x. grid_rows:
    programs per n tile, each on its own row of x and of out (alone-rows mode: M = 1 a program; 1 otherwise),
    neighbours in the grid, so that codes read from memory for one row are in L2 for the others."""
    allow_next(PDL)
    pid_n, pid_k = tl.program_id(0) // grid_rows, tl.program_id(1)
    x += (tl.program_id(0) % grid_rows).to(tl.int64) * stride_xm
    out += (tl.program_id(0) % grid_rows).to(tl.int64) * stride_om
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    up = up_rows + offs_n                                                               # [BN] the up rows
    # the first k-tile's codes are read before the wait (pdl.py: no kernel writes weights)
    bits, bits_up = _code_tiles(qw, offs_n, up, n_ok, k_begin, k_end, stride_qn, FMT, BLOCK_K,
                                SILU_MUL, EVICTION)
    wait_for_previous(PDL)
    acc, acc_up = _gemv_tiles(acc, acc_up, bits, bits_up, k_begin, x, scales, zeros, offs_n, up, n_ok,
                              offs_m, k_end, M, stride_xm, stride_sn, stride_zn, FMT, GROUP, HAS_ZERO, HAS_MIN,
                              BLOCK_M, BLOCK_N, BLOCK_K, SUB, SILU_MUL)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        bits, bits_up = _code_tiles(qw, offs_n, up, n_ok, k0, k_end, stride_qn, FMT, BLOCK_K,
                                    SILU_MUL, EVICTION)
        acc, acc_up = _gemv_tiles(acc, acc_up, bits, bits_up, k0, x, scales, zeros, offs_n, up, n_ok,
                                  offs_m, k_end, M, stride_xm, stride_sn, stride_zn, FMT, GROUP, HAS_ZERO, HAS_MIN,
                                  BLOCK_M, BLOCK_N, BLOCK_K, SUB, SILU_MUL)
    dst = out + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SILU_MUL:
        dt = out.dtype.element_ty
        y = _silu_mul_rounded(_round(acc, dt, SOFT_BF16), _round(acc_up, dt, SOFT_BF16), dt, SOFT_BF16)
        tl.store(dst, y.to(dt), mask=(offs_m < M)[:, None] & n_ok[None, :])
    else:
        tl.store(dst, acc, mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def dequantize_kernel(qw, scales, zeros, out, N, K, stride_qn, stride_sn, stride_zn, stride_on,
                      FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n tile, k tile): out[n, k] = (code - zero) * scale (HAS_MIN: code * scale + min) in out's dtype (for
    a cuBLAS GEMM)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = offs_n < N
    g = k0 // GROUP
    scale = tl.load(scales + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_ZERO:
        zero = tl.load(zeros + offs_n * stride_zn + g, mask=n_ok, other=0).to(tl.float32)[:, None]
    elif FMT == 2:
        zero = 8.0
    else:
        zero = 0.0
    mn = 0.0
    if HAS_MIN:
        mn = tl.load(zeros + offs_n * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    q_rows = qw.to(tl.pointer_type(tl.uint8), bitcast=True) + offs_n.to(tl.int64)[:, None] * stride_qn
    o_rows = out + offs_n.to(tl.int64)[:, None] * stride_on
    if FMT <= 1 or FMT == FMT_FP8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (offs_k < K)[None, :]
        bits = tl.load(q_rows + offs_k[None, :], mask=ok, other=0)
        if FMT != FMT_FP8:
            bits = bits.to(tl.int32)
        tl.store(o_rows + offs_k[None, :], (_code_values(bits, zero, FMT) * scale).to(out.dtype.element_ty), mask=ok)
    else:
        p = tl.arange(0, BLOCK_K // 2)
        k_lo = k0 + (p // 16) * 32 + p % 16
        ok = n_ok[:, None] & (k_lo < K)[None, :]
        byte = tl.load(q_rows + (k0 // 2 + p)[None, :], mask=ok, other=0).to(tl.int32)
        lo = _code_values(byte & 15, zero, FMT) * scale
        hi = _code_values(byte >> 4, zero, FMT) * scale
        if HAS_MIN:   # the launch turns fused multiply-adds off: the product is rounded first, as the reference's
            lo += mn
            hi += mn
        tl.store(o_rows + k_lo[None, :], lo.to(out.dtype.element_ty), mask=ok)
        tl.store(o_rows + (k_lo + 16)[None, :], hi.to(out.dtype.element_ty), mask=ok)
