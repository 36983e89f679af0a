"""InstantQuant's weight formats (quant/formats.py) by hand: the codes of worked examples, the 4-bit packing
layout, the round trip's error bound for every format and group size, zero rows."""
from __future__ import annotations

import pytest
import torch

from allspark_server.quant.formats import ALL_FORMATS, FORMATS, dequantize, pack4, quantize, unpack4


def test_int8_per_channel_codes_by_hand():
    # the row's value of largest magnitude is -2.0: scale = -2 / -128 = 1/64, codes = w * 64
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.25]])
    q = quantize(w, "int8", -1)
    assert q["qweight"].dtype == torch.int8 and q["qweight"].tolist() == [[64, -128, 32, 0, 16]]
    assert q["scales"].dtype == torch.float16 and q["scales"].tolist() == [[1 / 64]]
    assert "zeros" not in q


def test_fp8_e4m3_codes_by_hand():
    """OCP E4M3 (sign, 4 exponent bits of bias 7, 3 mantissa bits): max |w| = 2 gives scale 2 / 448 = 1/224, so
    w / scale = 224 (1.75 * 2^7: exponent 14, mantissa 6), -448 (1.75 * 2^8 with the sign), 112 (1.75 * 2^6),
    0, 67.2 (1.05 * 2^6: mantissa 0.4 / 8 rounds to 0, the value 64) and 0.00672 (below 2^-6: a subnormal,
    3.44 steps of 2^-9, code 3)."""
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.3, 0.00003]])
    q = quantize(w, "fp8_e4m3", -1)
    assert q["qweight"].dtype == torch.uint8 and "zeros" not in q
    assert q["qweight"].tolist() == [[0b0_1110_110, 0b1_1111_110, 0b0_1101_110, 0, 0b0_1101_000, 0b0_0000_011]]
    assert q["scales"].dtype == torch.float32 and q["scales"].tolist() == [[torch.tensor(2 / 448).item()]]
    back = dequantize(q["qweight"], q["scales"], None, "fp8_e4m3", -1)
    values = torch.tensor([[224, -448, 112, 0, 64, 3 * 2.0 ** -9]])
    assert torch.equal(back, values * q["scales"])          # code * scale, in fp32


def test_uint4_codes_by_hand():
    # lo = -1, hi = 2: scale = 3 / 15 = 0.2 (fp16: 0.199951171875), zero = round(1 / 0.19995) = 5
    w = torch.tensor([[-1.0, 2.0, 0.0, 0.4] * 8])
    q = quantize(w, "uint4", 32)
    s = torch.tensor(0.2).half().item()
    assert q["scales"].tolist() == [[s]] and q["zeros"].tolist() == [[5]]
    codes = [min(15, max(0, round(v / s) + 5)) for v in (-1.0, 2.0, 0.0, 0.4)]
    assert codes == [0, 15, 5, 7]
    assert unpack4(q["qweight"]).tolist() == [codes * 8]


def test_pack4_layout_by_hand():
    # k = 0..15 in the low nibbles of bytes 0..15, k = 16..31 in their high nibbles
    codes = torch.tensor([list(range(16)) + list(range(15, -1, -1))])
    packed = pack4(codes)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8
    assert packed[0].tolist() == [j | ((15 - j) << 4) for j in range(16)]
    assert torch.equal(unpack4(packed), codes.to(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [-1, 32, 128])
def test_round_trip_error_is_within_half_a_step(fmt, group):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 256, generator=g) * torch.rand(37, 1, generator=g)      # rows of different ranges
    q = quantize(w, fmt, group)
    back = dequantize(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, group)
    step = q["scales"].float().abs().repeat_interleave(256 if group == -1 else group, dim=1)
    err = (back - w).abs()
    # rounding: half a step; at the ends of a group's range a clamped code costs up to one step (symmetric: the
    # side opposite the extreme; asymmetric: the integer zero point shifts the range by up to half a step)
    assert (err <= step + 1e-6).all()
    assert (err <= step * 0.5 + 1e-6).float().mean() > 0.99


@pytest.mark.parametrize("group", [-1, 32])
def test_fp8_round_trip_error_is_within_half_an_e4m3_step(group):
    """e4m3 keeps 3 mantissa bits: |w - back| <= 2^-4 |w| for normal values (half a step of 2^-3), and half the
    subnormal step (2^-10 of the scale) below 2^-6 of the scale."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(37, 256, generator=g) * torch.rand(37, 1, generator=g)
    q = quantize(w, "fp8_e4m3", group)
    back = dequantize(q["qweight"], q["scales"], None, "fp8_e4m3", group)
    scale = q["scales"].repeat_interleave(256 if group == -1 else group, dim=1)
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()


def test_zero_rows_quantize_to_zero():
    w = torch.zeros(3, 64)
    for fmt in ALL_FORMATS:
        q = quantize(w, fmt, 32)
        assert torch.equal(dequantize(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, 32), w)
