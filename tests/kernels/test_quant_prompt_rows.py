"""Prompt rows (hundreds of rows of x) against quantized weights with int8 x (activate_quant): the native kernel at
every ISA level this CPU has against float64, with row counts past the kernels' blocks of rows and weight rows that
are no multiple of their tiles; which weights ops.linear keeps native at every row count (QuantWeight
native_at_any_rows), and that a row's bits do not depend on the rows beside it there."""
from __future__ import annotations

import pytest
import torch
from quant_cases import isa_levels, needs_native, quantized_weight, round_to_int8_levels

from allspark_server.compute import ops

# (fmt, n, k, group): K = 640 and 1088 end inside a 512-wide chunk; 700 x 1024 spans two tiles of weight rows per
# thread (native/gemv_quant_lanes.cpp: LANES_TILE_BYTES); 97 rows is no multiple of the 3 weight rows per step
CASES = (("int4", 97, 640, 32), ("uint4_min", 97, 640, 64), ("int8", 97, 1088, 32), ("uint4", 97, 640, 128),
         ("int4", 700, 1024, 256), ("uint4_min", 700, 1024, 32))
ROWS = (300, 517)   # past M_BLOCK (256) rows, no multiple of 4 rows per pass


def _weight(case, seed):
    fmt, n, k, group = case
    return quantized_weight(n, k, fmt, group, seed=seed, act_bits=8)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_prompt_rows_of_int8_x_match_float64(isa):
    ext = ops.native()
    g = torch.Generator().manual_seed(70)
    for i, case in enumerate(CASES):
        if isa == ops.ISA_PORTABLE and case[1] > 100:
            continue   # the portable kernel is slow; the small shapes cover it
        qw = _weight(case, 800 + i)
        w64 = qw.dequantize().double()
        bias = torch.randn(case[1], generator=g)
        for m, dtype in zip(ROWS, (torch.float32, torch.bfloat16)):
            x = torch.randn(m, case[2], generator=g).to(dtype)
            y = ext.linear_quant(x, ops.native_weight(qw), bias.to(dtype), isa)
            ref = round_to_int8_levels(x) @ w64.T + bias.to(dtype).double()
            # integer sums per block are exact; only the fp32 sum over the blocks and the output rounding remain
            tol = 1e-5 * (x.double().abs() @ w64.abs().T).max().item() + 1e-6
            rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
            assert y.dtype == dtype and y.shape == (m, case[1])
            assert ((y.double() - ref).abs() <= tol + rounding).all(), (case, m, dtype, isa)


# which activate_quant / weight-only weights (fmt, group, act_bits) meet every row count natively, K = 1024, by ISA
# level: AVX-512 VNNI's lanes kernel takes groups of 32 .. 256 (not uint8), AVX2's 4-bit codes in groups of 32 and
# int8 codes in groups of multiples of 32 (gemv_quant_avx2_bytes8.cpp)
NATIVE_AT_ANY_ROWS = {
    ("int8", 32, 8): (True, True), ("int8", 128, 8): (True, True), ("int4", 64, 8): (False, True),
    ("uint4", 128, 8): (False, True),
    ("uint4_min", 256, 8): (False, True), ("int4", 32, 8): (True, True), ("uint4", 32, 8): (True, True),
    ("uint4_min", 32, 8): (True, True), ("uint8", 32, 8): (False, False), ("int8", -1, 8): (False, False),
    ("int4", 512, 8): (False, False), ("int4", 32, 16): (False, False), ("uint4_min", 32, 16): (False, False)}
# int4 g32 with int8 x by K: the VNNI kernel pads K to chunks of 512 (576 -> 1024: 1.78x, 640: 1.6x, dequantized;
# 1280 -> 1536: 1.2x, native); the AVX2 one needs whole runs of 64 k (608 has 19 groups of 32)
NATIVE_BY_K = {576: (True, False), 640: (True, False), 1280: (True, True), 608: (False, False)}


def _native_expected(table_entry, isa):
    avx2, vnni = table_entry
    return vnni if isa >= ops.ISA_AVX512_VNNI else avx2 if isa >= ops.ISA_AVX2 else False


@needs_native
def test_ops_linear_keeps_grouped_int8_x_weights_native_at_every_row_count(monkeypatch):
    """The weights QuantWeight.native_at_any_rows keeps native, at every ISA level this CPU runs (the table above),
    and ops.linear's routing at the CPU's own: those meet prompt rows in the native kernel, the others are
    dequantized for ATen's GEMM."""
    ext, isa = ops.native(), ops.isa_level()
    calls = []
    dequantized = ops.linear_dequantized
    monkeypatch.setattr(ops, "linear_dequantized", lambda *a: calls.append(a[0].shape[0]) or dequantized(*a))
    monkeypatch.setattr(ops, "INT8_GEMM", False)
    g = torch.Generator().manual_seed(71)
    x = torch.randn(ext.QUANT_NATIVE_MAX_ROWS + 40, 1024, generator=g)
    for k, entry in NATIVE_BY_K.items():
        other = ops.native_weight(quantized_weight(8, k, "int4", 32, seed=73, act_bits=8))
        for level in range(isa + 1):
            assert other.native_at_any_rows(level) == _native_expected(entry, level), (k, level)
    for (fmt, group, act_bits), entry in NATIVE_AT_ANY_ROWS.items():
        qw = quantized_weight(48, 1024, fmt, group, seed=72, act_bits=act_bits)
        for level in range(isa + 1):
            assert ops.native_weight(qw).native_at_any_rows(level) == _native_expected(entry, level), (fmt, level)
        native = _native_expected(entry, isa)
        calls.clear()
        y = ops.linear(x, qw)
        assert calls == ([] if native else [x.shape[0]]), (fmt, group, act_bits)
        rounded = round_to_int8_levels(x) if act_bits == 8 else x.double()
        ref = rounded @ qw.dequantize().double().T
        # the dequantized GEMM runs in x's dtype here (fp32); the native kernel sums exactly per block
        assert (y.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), (fmt, group, act_bits)


@needs_native
def test_a_prompt_row_is_the_same_whatever_rows_share_the_call():
    """Bit for bit at the AVX-512 VNNI level: rows of a 600-row call (three blocks of rows of the lanes kernel) equal
    the same rows in calls of 12 (its fewest) and 200 rows, and alone or in fives, where the other AVX-512 kernel
    takes them: both sum each block exactly, scale the blocks in the same lanes in the same order (UINT4_MIN's min
    term first) and add the lanes up the same way."""
    if ops.isa_level() < ops.ISA_AVX512_VNNI:
        pytest.skip("the lanes kernel needs AVX-512 VNNI")
    ext, isa = ops.native(), ops.ISA_AVX512_VNNI
    g = torch.Generator().manual_seed(73)
    for i, case in enumerate(CASES):
        qw = ops.native_weight(_weight(case, 900 + i))
        x = torch.randn(600, case[2], generator=g).bfloat16()
        full = ext.linear_quant(x, qw, None, isa)
        for start, m in ((0, 12), (250, 12), (391, 200), (588, 12), (0, 1), (257, 1), (599, 1), (300, 5)):
            assert torch.equal(ext.linear_quant(x[start:start + m], qw, None, isa), full[start:start + m]), (case, m)
