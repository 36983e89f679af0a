"""FP8 x FP8 matmuls: fp8_e4m3 weights with activate_quant (W8A8). Each row of x is rounded to e4m3 with a
power-of-two scale (reference.fp8_activations) by one Triton launch (`_round_rows_kernel`: the reference's dozen
torch ops were a dozen launches a projection, which made a 128-row decode step slower than bf16's). More than
GEMV_MAX_ROWS rows of bf16 x meet the weight's codes in torch._scaled_mm (cuBLASLt's FP8 GEMM on the tensor cores,
with row-wise scales: x's per row, the weight's per output channel); a row or two, and what _scaled_mm does not
take, feed the rounded rows, exact in x's dtype, to the fp8 GEMV (quant_kernels.quant_matmul): the same products,
summed in another order.

The kernel rounds on the bits, so it is exact everywhere the interpreter runs too: the scale is the smallest power
of two >= max|x| / 448 (1 for a row of zeros or one with inf or NaN, as frexp gives), x / scale is exact, and its
rounding to e4m3's grid (3 mantissa bits, quantum 2^-9 below 2^-6) to nearest even is (v + c) - c with c 1.5 x 2^23
quanta. Codes are written as e4m3 bytes (sign, 4 exponent bits of bias 7, 3 mantissa bits; NaN 0x7F)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda.quant_kernels import GEMV_MAX_ROWS, LaunchConfig, quant_matmul
from allspark_server.quant.formats import QuantizedWeight

SCALED_MM_ALIGN = 16            # cuBLASLt's FP8 GEMM: K and N multiples of 16


def takes_fp8_activations(w: QuantizedWeight) -> bool:
    return w.act_bits == 8 and w.fmt == "fp8_e4m3"


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (int32)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_rows_kernel(x, codes, scales, rounded, K, stride_xm, stride_cm, stride_rm, BLOCK_K: tl.constexpr,
                       CODES: tl.constexpr):
    """Program = one row of x: its scale (fp32) and each element rounded to e4m3 at that scale: as bytes into
    codes (CODES), or times the scale into `rounded` in x's dtype (exact there)."""
    row = tl.program_id(0).to(tl.int64)
    x += row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.abs(tl.load(x + offs, mask=offs < K, other=0.0).to(tl.float32))
        amax = tl.where((v > amax) | (v != v), v, amax)                  # a NaN stays: the row's scale is 1
    a = tl.math.div_rn(tl.max(tl.where(amax != amax, float("inf"), amax), 0), 448.0)
    tiny = a < 1.1754943508222875e-38                                    # below fp32's normals: 2^64 up first
    an = tl.where(tiny, a * 18446744073709551616.0, a)
    bits = an.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)      # ceil(log2 an)
    scale = _pow2(tl.minimum(e, 127))
    scale = tl.where(tiny, scale * 5.421010862427522e-20, scale)                       # 2^-64 back down
    scale = tl.where((a == 0) | (a == float("inf")), 1.0, scale)
    tl.store(scales + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        ok = offs < K
        xv = tl.load(x + offs, mask=ok, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(xv, scale), -448.0), 448.0)      # exact: scale is a power of 2
        mag = tl.abs(v)
        ev = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # e4m3 subnormals below 2^-6
        c = _pow2(ev - 3) * 12582912.0                                   # 1.5 x 2^23 quanta of 2^(ev - 3)
        r = (mag + c) - c                                                # |v| to e4m3's grid, ties to even
        r = tl.where(v != v, v, r)
        rb = r.to(tl.int32, bitcast=True)
        re = ((rb >> 23) & 0xFF) - 127
        neg = v.to(tl.int32, bitcast=True) < 0                           # -0 too
        sign = neg.to(tl.int32) << 7
        normal = ((re + 7) << 3) | ((rb >> 20) & 0x7)
        sub = (r * 512.0).to(tl.int32)                                   # multiples of 2^-9 below 2^-6
        byte = sign | tl.where(r >= 0.015625, normal, sub)
        byte = tl.where(v != v, 0x7F, byte)
        if CODES:
            tl.store(codes + row * stride_cm + offs, byte.to(tl.uint8), mask=ok)
        else:
            signed = tl.where(neg, -r, r)
            out = tl.where(v != v, v, signed * scale)
            tl.store(rounded + row * stride_rm + offs, out.to(rounded.dtype.element_ty), mask=ok)


ROUND_BLOCK = 2048


def _round_rows(x: torch.Tensor, codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as bytes [M, K], or the rounded rows in x's dtype; scales fp32 [M, 1]): one launch."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.uint8 if codes else x.dtype, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _round_rows_kernel[(m,)](x, out, scales, out, k, x.stride(0), out.stride(0), out.stride(0),
                                 BLOCK_K=min(ROUND_BLOCK, triton.next_power_of_2(k)), CODES=codes, num_warps=4,
                                 enable_fp_fusion=False)
    return out, scales


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.fp8_activations in one launch: (codes float8_e4m3fn [M, K], scales fp32 [M, 1])."""
    codes, scales = _round_rows(x, codes=True)
    return codes.view(torch.float8_e4m3fn), scales


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows rounded as fp8_activations rounds them, in x's dtype (exact there), in one launch."""
    return _round_rows(x, codes=False)[0]


def scaled_mm_fits(x: torch.Tensor, w: QuantizedWeight) -> bool:
    """Whether torch._scaled_mm takes this product: bf16 x (row-wise scales want a bf16 result), per-channel weight
    scales, aligned K and N."""
    return (x.dtype == torch.bfloat16 and w.group_size == -1 and w.in_features % SCALED_MM_ALIGN == 0
            and w.out_features % SCALED_MM_ALIGN == 0)


def fp8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
               config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] @ the fp8 weight [N, K].T (+ bias) with x rounded to e4m3 per row -> [M, N] in x's dtype. A config
    (alone-rows mode) keeps the GEMV at any row count."""
    if config is None and x.shape[0] > GEMV_MAX_ROWS and scaled_mm_fits(x, w):
        codes, scale = fp8_rows(x)
        y = torch._scaled_mm(codes, w.qweight.view(torch.float8_e4m3fn).t(), scale_a=scale,
                             scale_b=w.scales.view(1, -1), out_dtype=x.dtype)
        return y if bias is None else y + bias
    return quant_matmul(rounded_rows(x), w, bias, config)
