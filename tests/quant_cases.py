"""The quantized-kernel tests' cases: random quantized weights, the (format, N, K, group) shapes that reach every
kernel path, the ISA levels this CPU runs, x rounded to int8 per row as activate_quant rounds it, and the float64
check of ext.linear_quant (test_quant_kernels.py, test_quant_int8_gemv.py, test_quant_midm.py)."""
from __future__ import annotations

import functools

import pytest
import torch

from allspark_client import settings
from allspark_server.compute import ops, reference
from allspark_server.quant.formats import FORMATS, QuantizedWeight, quantize

needs_native = pytest.mark.skipif(settings.NO_NATIVE.get() or ops.native() is None,
                                  reason="native path disabled")


def quantized_weight(n, k, fmt, group, seed, act_bits=16):
    """A random [n, k] weight (N(0, 0.05)) quantized into `fmt` / `group`."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q = quantize(w, fmt, group)
    return QuantizedWeight(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, group, k, act_bits)


def quant_cases():
    """(fmt, n, k, group) of every format: the shapes and group sizes that reach each kernel path."""
    for fmt in FORMATS:
        # K = 640: one whole chunk of the AVX-512 kernel (512 k) and a partial one; G = 1024: chunks inside
        # larger groups; G = 96: a group size the AVX-512 kernel leaves to the AVX2 one; K = 1024: the AVX2
        # 4-bit batch-1 kernel's runs of eight groups with no groups left over (640: with some left over; 1280:
        # eight groups of 128 and two more; 1536: eight groups of 128 and four more, the benchmark model's width)
        for n, k, groups in ((7, 32, (-1, 32)), (33, 96, (-1, 32)), (130, 512, (-1, 64, 128, 256, 512)),
                             (64, 257, (-1,)), (300, 1000, (-1,)), (21, 640, (-1, 32, 64, 128)),
                             (11, 1024, (32, 64, 128)), (13, 1280, (128,)),
                             (17, 2048, (1024,)), (9, 192, (96,)), (5, 1536, (32, 64, 128))):
            if "4" in fmt and k % 32:
                continue
            for group in groups:
                yield fmt, n, k, group


def isa_levels() -> list[int]:
    """Every level this CPU runs: 3 = AVX-512 VNNI (its own GEMV), 2 = AVX-512 without VNNI (the AVX2 GEMV, the
    AVX-512 dequantization), 1 = AVX2, 0 = portable."""
    return list(range(ops.isa_level() + 1))


def assert_linear_quant_matches_float64(cases, rows, dtype, isa, x_seed, weight_seed):
    """ext.linear_quant at `isa` for each (fmt, n, k, group) case (weight seed weight_seed + its index) and each
    count of rows of x (a bias on odd counts) against float64 on x as the kernel meets it."""
    ext = ops.native()
    for what, qw, x, b, ref, bound in float64_table(tuple(cases), tuple(rows), dtype, x_seed, weight_seed):
        y = ext.linear_quant(x, ops.native_weight(qw), b, isa)
        assert y.dtype == dtype and y.shape == ref.shape
        assert ((y.double() - ref).abs() <= bound).all(), (*what, dtype, isa)


@functools.lru_cache(maxsize=4)
def float64_table(cases: tuple, rows: tuple, dtype, x_seed, weight_seed) -> list[tuple]:
    """assert_linear_quant_matches_float64's inputs and float64 answers, made once for every ISA level's test:
    [((fmt, n, k, group, m), weight, x, bias or None, the float64 product, the bound on the error)]."""
    g = torch.Generator().manual_seed(x_seed)
    out = []
    for i, (fmt, n, k, group) in enumerate(cases):
        qw = quantized_weight(n, k, fmt, group, seed=weight_seed + i)
        w64 = qw.dequantize().double()
        bias = torch.randn(n, generator=g).to(dtype)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            b = bias if m % 2 else None
            # x as the kernel meets it: 16-bit fixed point per block of 32 (reference.round_activations_reference)
            ref = reference.round_activations_reference(x).double() @ w64.T + (0 if b is None else b.double())
            tol = 1e-5 * (x.double().abs() @ w64.abs().T).max().item() + 1e-6
            rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
            out.append(((fmt, n, k, group, m), qw, x, b, ref, tol + rounding))
    return out


def round_to_int8_levels(x: torch.Tensor) -> torch.Tensor:
    """activate_quant's x, written here: per row q = round(x * 127 / absmax) (fp32, half to even) times
    absmax / 127."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    assert q.abs().max() <= 127
    return q.double() * (amax.double() / 127.0)


def assert_int8_x_rows_match_float64(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor,
                                     what) -> None:
    """A kernel's x . w^T + bias for activate_quant's int8 x against float64 (w64: the weight dequantized): the block
    sums are exact integers, so only the fp32 sums over the blocks and the output rounding (x's dtype) remain."""
    ref = round_to_int8_levels(x) @ w64.T + bias.double()
    tol = 1e-5 * (x.double().abs() @ w64.abs().T).max().item() + 1e-6
    rounding = ref.abs() * (2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -24)
    assert y.dtype == x.dtype and y.shape == ref.shape, what
    assert ((y.double() - ref).abs() <= tol + rounding).all(), what
