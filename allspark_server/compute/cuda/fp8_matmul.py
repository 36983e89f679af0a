"""FP8 x FP8 matmuls: fp8_e4m3 weights with activate_quant (W8A8). Each row of x is rounded to e4m3 with a
power-of-two scale (reference.fp8_activations). More than GEMV_MAX_ROWS rows of bf16 x meet the weight's codes in
torch._scaled_mm (cuBLASLt's FP8 GEMM on the tensor cores, with row-wise scales: x's per row, the weight's per
output channel); a row or two, and what _scaled_mm does not take, feed the rounded rows, exact in x's dtype, to
the fp8 GEMV (quant_kernels.quant_matmul): the same products, summed in another order."""
from __future__ import annotations

import torch

from allspark_server.compute import reference as ref
from allspark_server.compute.cuda.quant_kernels import GEMV_MAX_ROWS, LaunchConfig, quant_matmul
from allspark_server.quant.formats import QuantizedWeight

SCALED_MM_ALIGN = 16            # cuBLASLt's FP8 GEMM: K and N multiples of 16


def takes_fp8_activations(w: QuantizedWeight) -> bool:
    return w.act_bits == 8 and w.fmt == "fp8_e4m3"


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows rounded as fp8_activations rounds them, in x's dtype (exact there)."""
    codes, scale = ref.fp8_activations(x)
    return (codes.float() * scale).to(x.dtype)


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
        codes, scale = ref.fp8_activations(x)
        y = torch._scaled_mm(codes, w.qweight.view(torch.float8_e4m3fn).t(), scale_a=scale,
                             scale_b=w.scales.view(1, -1), out_dtype=x.dtype)
        return y if bias is None else y + bias
    return quant_matmul(rounded_rows(x), w, bias, config)
