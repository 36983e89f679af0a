"""The quantized GEMV at decode batches of many streams (17..100 rows of x; ops.linear takes it up to
quant_native_rows): every format and ISA level this CPU has against float64, weights large enough to span several of the
kernels' row tiles, and batch invariance (a row's result does not depend on the rows next to it in the call)."""
from __future__ import annotations

import pytest
import torch
from quant_cases import assert_linear_quant_matches_float64, isa_levels, needs_native, quantized_weight

from allspark_server.compute import ops, reference
from allspark_server.quant.formats import FORMATS

ROWS = (17, 31, 32, 64, 100)


def _cases():
    """(fmt, n, k, group): K = 640 ends inside a chunk of the AVX-512 kernel; 1100 x 1024 spans more than one tile
    of rows per thread (native/gemv_quant.h: TILE_BYTES) in every format; 33 rows: odd counts per thread."""
    for fmt in FORMATS:
        for n, k, groups in ((33, 640, (-1, 32, 128)), (1100, 1024, (32,)), (70, 2048, (1024,)), (9, 192, (96,))):
            for group in groups:
                yield fmt, n, k, group


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_many_rows_match_float64(dtype, isa):
    assert_linear_quant_matches_float64(_cases(), ROWS, dtype, isa, x_seed=40, weight_seed=500)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("act_bits", [16, 8])
def test_a_row_is_the_same_whatever_rows_share_the_call(isa, act_bits):
    """Bit for bit: row i of a call with M rows equals row i computed with other rows around it. The AVX-512 VNNI
    and portable kernels give the same bits at every M, 1 included; the AVX2 level has batch-1 kernels of its own
    (gemv_quant_avx2_m1.cpp, another summation order), so there rows are compared from M >= 2 up."""
    ext = ops.native()
    g = torch.Generator().manual_seed(41)
    for i, (fmt, n, k, group) in enumerate(_cases()):
        if n > 100 and isa == ops.ISA_PORTABLE:
            continue   # the portable kernel is slow; the small shapes cover it
        qw = ops.native_weight(quantized_weight(n, k, fmt, group, seed=600 + i, act_bits=act_bits))
        x = torch.randn(100, k, generator=g).bfloat16()
        full = ext.linear_quant(x, qw, None, isa)
        alone = 1 if isa == ops.ISA_PORTABLE or isa >= ops.ISA_AVX512_VNNI else 2
        for m in (3, 4, 5, 6, 8, 17, 32, 64):     # 5: one pass of the AVX-512 kernel (MR_ONE_PASS), 6 and 8: two
            assert torch.equal(ext.linear_quant(x[:m], qw, None, isa), full[:m]), (fmt, n, k, group, m, isa)
        for j in (0, 5, 37, 99):
            rows = x[[j] * alone]
            assert torch.equal(ext.linear_quant(rows, qw, None, isa)[0], full[j]), (fmt, n, k, group, j, isa)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_ops_linear_is_native_up_to_the_row_limit(fmt, monkeypatch):
    """ops.linear takes the native kernel up to quant_native_rows rows (no dequantized GEMM: 64 with the AVX-512 VNNI
    kernel, 16 with the others) and the dequantized GEMM above it; both match float64."""
    ext = ops.native()
    limit = ext.quant_native_rows(ops.isa_level())
    assert limit == (64 if ops.isa_level() >= ops.ISA_AVX512_VNNI else 16)
    qw = quantized_weight(96, 128, fmt, 32, seed=9)
    calls = []
    dequantized = ops.linear_dequantized
    monkeypatch.setattr(ops, "linear_dequantized", lambda *a: calls.append(a[0].shape[0]) or dequantized(*a))
    g = torch.Generator().manual_seed(10)
    for m in (min(17, limit), limit, limit + 1):
        x = torch.randn(m, 128, generator=g)
        ref = reference.round_activations_reference(x).double() @ qw.dequantize().double().T
        assert (ops.linear(x, qw).double() - ref).abs().max().item() <= 1e-4, (fmt, m)
    assert calls == [limit + 1]
