"""The quantized GEMV on int8 x (act_bits 8, compute_method activate_quant) against float64 on x rounded to int8
per row: random weights of every format and group size, and the integer tricks at their limits (int16 lanes, codes
at both ends of their range, the many-row kernel that keeps each block's sum in one lane), every ISA level this CPU
has."""
from __future__ import annotations

import itertools

import pytest
import torch
from quant_cases import isa_levels, needs_native, quant_cases, round_to_int8_levels

from allspark_server.compute import ops
from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight, quantize


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_activate_quant_rounds_x_to_int8_per_row(isa):
    """act_bits 8 (compute_method activate_quant): every kernel meets x rounded to int8 per row; equal to a
    float64 product of that x with the dequantized weight, on every ISA level, below and above the native row
    limit (the dequantized GEMM then gets the same rounded x)."""
    ext = ops.native()
    g = torch.Generator().manual_seed(14)
    for i, (fmt, n, k, group) in enumerate(quant_cases()):
        q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(300 + i)) * 0.05, fmt, group)
        qw = QuantizedWeight(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, group, k, act_bits=8)
        weight_only = QuantizedWeight(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, group, k)
        nw = ops.native_weight(qw)
        assert nw.act_bits == 8
        w64 = qw.dequantize().double()
        for m in (1, 3, 16):
            x = torch.randn(m, k, generator=g)
            ref = round_to_int8_levels(x) @ w64.T
            tol = 1e-5 * (x.double().abs() @ w64.abs().T).max().item() + 1e-6
            assert (ext.linear_quant(x, nw, None, isa).double() - ref).abs().max() <= tol, (fmt, n, k, group, m)
            # the 16-bit rounding of weight-only is a different (far finer) result
            if m == 1 and k >= 96:
                assert (ops.linear_reference(x, weight_only).double() - ref).abs().max() > 10 * tol
    x = torch.randn(ops.native().quant_native_rows(ops.isa_level()) + 8, 96, generator=g)
    q = quantize(torch.randn(24, 96, generator=g) * 0.05, "int8", -1)
    qw = QuantizedWeight(q["qweight"], q["scales"], None, "int8", -1, 96, act_bits=8)
    ref = round_to_int8_levels(x) @ qw.dequantize().double().T
    assert (ops.linear(x, qw).double() - ref).abs().max() <= 1e-4    # above the row limit: the dequantized GEMM
    assert (ops.linear_reference(x, qw).double() - ref).abs().max() <= 1e-4
    with pytest.raises(RuntimeError, match="act_bits"):
        ext.QuantWeight(q["qweight"], q["scales"], None, FORMAT_IDS["int8"], 96, 4)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_int8_activations_at_the_int16_limit(isa):
    """The batch-1 AVX2 4-bit kernel keeps int8 x's products in int16 lanes up to 4 * 2 * 15 * 127 = 30480 before
    widening; with every code 15 and every |q| 127 each lane reaches that bound, and the result must still equal a
    float64 product (an overflow would wrap by 65536 per lane). Every group size it takes, with full runs of eight
    groups and groups left over (K 1536 and 640)."""
    ext = ops.native()
    for fmt, group, k in itertools.product(("int4", "uint4"), (32, 64, 128), (1536, 640)):
        n = 24
        codes = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)                  # every nibble 15
        scales = torch.full((n, k // group), 0.01).half()
        zeros = torch.zeros(n, k // group, dtype=torch.uint8) if fmt == "uint4" else None
        qw = QuantizedWeight(codes, scales, zeros, fmt, group, k, act_bits=8)
        w64 = qw.dequantize().double()
        for sign in (1.0, -1.0):
            x = torch.full((1, k), sign)                                            # every q = +-127
            ref = round_to_int8_levels(x) @ w64.T
            y = ext.linear_quant(x, ops.native_weight(qw), None, isa).double()
            assert (y - ref).abs().max() <= 1e-6 * ref.abs().max(), (fmt, group, k, sign, isa)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_int8_codes_at_their_extremes_meet_int8_x(isa):
    """With int8 x, the AVX-512 kernel meets int8 codes as unsigned bytes code + 128 and takes 128 times x's block
    sums off again. Codes -128 and 127 (a GGUF Q8_0 block may hold -128) against every |q| = 127, per channel and in
    groups, one and several rows of x (K 640: a chunk and part of one): equal to a float64 product."""
    ext = ops.native()
    k, n = 640, 24
    for group, sign, m in itertools.product((-1, 32, 128), (1.0, -1.0), (1, 5)):
        codes = torch.where(torch.arange(n * k).reshape(n, k) % 3 == 0, -128, 127).to(torch.int8)
        groups = 1 if group == -1 else k // group
        qw = QuantizedWeight(codes, torch.full((n, groups), 0.01).half(), None, "int8", group, k, act_bits=8)
        x = torch.full((m, k), sign)
        x[:, 1::7] = -sign                                                          # every q = +-127
        ref = round_to_int8_levels(x) @ qw.dequantize().double().T
        y = ext.linear_quant(x, ops.native_weight(qw), None, isa).double()
        assert (y - ref).abs().max() <= 1e-6 * ref.abs().max(), (group, sign, m, isa)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_many_rows_of_int8_x_meet_codes_at_their_extremes(isa):
    """From 12 rows of int8 x on, grouped weights (groups of 32 .. 256) take the kernel that keeps each block's sum in
    one lane (native/gemv_quant_lanes.cpp): codes as signed bytes code - z, x as unsigned bytes x + 128, and the
    weight's own 128 * (sum of code - z) taken off per block. Codes at both ends of their range (zero points too)
    against every |q| = 127, every format it takes, K with a partial chunk (640) and three whole ones (1536), 13 rows
    (three passes of four and one row) and 32, an odd count of weight rows: equal to a float64 product."""
    ext = ops.native()
    n = 23
    for fmt, group, k in itertools.product(("int8", "int4", "uint4", "uint4_min"), (32, 64, 256), (640, 1536)):
        if k % group:
            continue
        four = "4" in fmt
        top, low = (15, 0) if four else (127, -128)
        pattern = torch.arange(n * k).reshape(n, k) % 5 < 2
        codes = torch.where(pattern, top, low)
        if four:
            codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)   # the packing: only its values matter
        else:
            codes = codes.to(torch.int8)
        groups = k // group
        scales = torch.linspace(0.005, 0.02, n * groups).reshape(n, groups).half()
        zeros = None
        if fmt == "uint4":
            zeros = torch.where(torch.arange(n * groups).reshape(n, groups) % 2 == 0, 0, 15).to(torch.uint8)
        elif fmt == "uint4_min":
            zeros = torch.linspace(-0.1, 0.05, n * groups).reshape(n, groups).half()
        qw = QuantizedWeight(codes, scales, zeros, fmt, group, k, act_bits=8)
        w64 = qw.dequantize().double()
        for m, sign in itertools.product((13, 32), (1.0, -1.0)):
            x = torch.full((m, k), sign)
            x[:, 1::3] = -sign                                                      # every q = +-127
            x[1::2, 2::5] *= 0.5
            ref = round_to_int8_levels(x) @ w64.T
            y = ext.linear_quant(x, ops.native_weight(qw), None, isa).double()
            assert (y - ref).abs().max() <= 1e-6 * ref.abs().max(), (fmt, group, k, m, sign, isa)
    g = torch.Generator().manual_seed(21)
    for i, (fmt, n, k, group) in enumerate(quant_cases()):   # random weights and x, 33 rows: 8 passes of 4 and 1 row
        q = quantize(torch.randn(n, k, generator=g) * 0.05, fmt, group)
        qw = QuantizedWeight(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, group, k, act_bits=8)
        x = torch.randn(33, k, generator=g)
        ref = round_to_int8_levels(x) @ qw.dequantize().double().T
        tol = 1e-5 * (x.double().abs() @ qw.dequantize().double().abs().T).max().item() + 1e-6
        assert (ext.linear_quant(x, ops.native_weight(qw), None, isa).double()
                - ref).abs().max() <= tol, (fmt, k, group)
