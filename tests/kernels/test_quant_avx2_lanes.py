"""The AVX2 kernel for several rows of int8 x against 4-bit codes in groups of 32 (native/gemv_quant_avx2_lanes.cpp):
against float64 at the AVX2 levels this CPU runs (1: AVX2, 2: AVX-512's AVX2 GEMV), with K of whole runs of eight
groups and with 2, 4 or 6 groups left over, weight rows no multiple of its 2 per step and rows of x no multiple of its
3 per pass nor of its block of 256; and bit for bit, every row of a call equals the same row alone (the batch-1
kernel), whatever rows share the call."""
from __future__ import annotations

import pytest
import torch
from quant_cases import assert_int8_x_rows_match_float64, needs_native, quantized_weight

from allspark_server.compute import ops

# (n, k): K = 576 (SmolLM2) leaves 2 groups after two runs of eight, 640 4, 192 6 (and no whole run), 1536 none
SHAPES = ((97, 576), (31, 640), (9, 192), (33, 1536), (50, 896))
FORMATS = ("int4", "uint4", "uint4_min")


def avx2_levels() -> list[int]:
    return [isa for isa in (ops.ISA_AVX2, ops.ISA_AVX512) if isa <= ops.isa_level()]


pytestmark = [needs_native, pytest.mark.skipif(not avx2_levels(), reason="the kernel needs AVX2")]


def _weight(fmt, n, k):
    return quantized_weight(n, k, fmt, 32, seed=n + k, act_bits=8)


@pytest.mark.parametrize("isa", avx2_levels())
@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_match_float64(isa, fmt):
    ext = ops.native()
    g = torch.Generator().manual_seed(5)
    for n, k in SHAPES:
        qw = _weight(fmt, n, k)
        w64 = qw.dequantize().double()
        bias = torch.randn(n, generator=g)
        for m, dtype in ((7, torch.float32), (300, torch.bfloat16)):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = ext.linear_quant(x, ops.native_weight(qw), bias.to(dtype), isa)
            assert_int8_x_rows_match_float64(y, x, w64, bias.to(dtype), (fmt, n, k, m, isa))


@pytest.mark.parametrize("isa", avx2_levels())
def test_a_row_is_the_same_bits_in_any_call(isa):
    ext = ops.native()
    g = torch.Generator().manual_seed(6)
    for fmt in FORMATS:
        for n, k in SHAPES:
            qw = ops.native_weight(_weight(fmt, n, k))
            x = torch.randn(300, k, generator=g)
            full = ext.linear_quant(x, qw, None, isa)    # past the kernel's block of 256 rows of x
            alone = torch.cat([ext.linear_quant(x[i:i + 1], qw, None, isa) for i in (0, 1, 2, 150, 299)])
            assert torch.equal(alone, full[[0, 1, 2, 150, 299]]), (fmt, n, k, isa)
            for start, m in ((0, 4), (3, 5), (10, 2), (100, 200), (296, 4)):
                part = ext.linear_quant(x[start:start + m], qw, None, isa)
                assert torch.equal(part, full[start:start + m]), (fmt, n, k, start, m, isa)
