"""The AVX2 kernels for several rows of int8 x against int8 codes (native/gemv_quant_avx2_bytes8.cpp: GGUF's Q8_0,
InstantQuant's int8): against float64 at the AVX2 levels this CPU runs (1: AVX2, 2: AVX-512's AVX2 GEMV), in groups
of 32 (in lanes, with 0 to 7 groups after the units of eight), 64 and 96 and per channel, codes of -128 included (the
kernels meet the codes' magnitudes), weight rows no multiple of 2 per step, rows of x no multiple of 3 per pass nor
of the 256 made into lanes at a time, and more weight rows than one tile; and bit for bit, every row of a call equals
the same row alone (the batch-1 kernel), whatever rows share the call. Also: the
engine's prompt rows of such a weight stay on the kernel (QuantWeight::native_at_any_rows)."""
from __future__ import annotations

import pytest
import torch
from quant_cases import assert_int8_x_rows_match_float64, needs_native, quantized_weight

from allspark_server.compute import ops

# (n, k, group). Groups of 32 go into units of eight groups: K = 576 (SmolLM2) two units and 2 groups left over, 896
# three and 4, 608 two and 3, 224 none and 7; n = 700 at K 576: more weight rows than a tile. 1536: per channel
CASES = ((97, 576, 32), (31, 640, 64), (9, 192, 96), (33, 1536, -1), (700, 576, 32), (50, 896, 32), (41, 608, 32),
         (17, 224, 32))


def avx2_levels() -> list[int]:
    return [isa for isa in (ops.ISA_AVX2, ops.ISA_AVX512) if isa <= ops.isa_level()]


pytestmark = [needs_native, pytest.mark.skipif(not avx2_levels(), reason="the kernel needs AVX2")]


def _weight(n, k, group):
    qw = quantized_weight(n, k, "int8", group, seed=n + k, act_bits=8)
    qw.qweight[0, :40] = -128            # the largest magnitude, 128 as an unsigned byte
    qw.qweight[-1, -40:] = 127
    return qw


@pytest.mark.parametrize("isa", avx2_levels())
def test_many_rows_match_float64(isa):
    ext = ops.native()
    g = torch.Generator().manual_seed(5)
    for n, k, group in CASES:
        qw = _weight(n, k, group)
        w64 = qw.dequantize().double()
        bias = torch.randn(n, generator=g)
        for m, dtype in ((2, torch.float32), (7, torch.float32), (300, torch.bfloat16)):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = ext.linear_quant(x, ops.native_weight(qw), bias.to(dtype), isa)
            assert_int8_x_rows_match_float64(y, x, w64, bias.to(dtype), (n, k, group, m, isa))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])   # bf16: rounded a tile at a time (FinishBlock)
@pytest.mark.parametrize("isa", avx2_levels())
def test_a_row_is_the_same_bits_in_any_call(isa, dtype):
    ext = ops.native()
    g = torch.Generator().manual_seed(6)
    for n, k, group in CASES:
        qw = ops.native_weight(_weight(n, k, group))
        x = torch.randn(300, k, generator=g).to(dtype)
        full = ext.linear_quant(x, qw, None, isa)
        alone = torch.cat([ext.linear_quant(x[i:i + 1], qw, None, isa) for i in (0, 1, 2, 50, 299)])
        assert torch.equal(alone, full[[0, 1, 2, 50, 299]]), (n, k, group, isa)
        for start, m in ((0, 2), (3, 5), (10, 4), (40, 60), (96, 8), (280, 20)):
            part = ext.linear_quant(x[start:start + m], qw, None, isa)
            assert torch.equal(part, full[start:start + m]), (n, k, group, start, m, isa)


def test_prompt_rows_of_grouped_int8_stay_native_on_avx2():
    """Grouped int8 codes with int8 x take the kernel at any row count on AVX2 (no dequantized GEMM); per channel
    they do not (the int8 GEMM or the dequantized one serves them)."""
    assert ops.native_weight(_weight(9, 192, 32)).native_at_any_rows(ops.ISA_AVX2)
    assert ops.native_weight(_weight(9, 192, 64)).native_at_any_rows(ops.ISA_AVX2)
    assert not ops.native_weight(_weight(33, 1536, -1)).native_at_any_rows(ops.ISA_AVX2)
    assert not ops.native_weight(quantized_weight(9, 192, "int8", 32, seed=1, act_bits=16)).native_at_any_rows(
        ops.ISA_AVX2)
