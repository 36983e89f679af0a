"""Gemma 2's pieces of the native CPU kernels: attention logit soft-capping and sliding windows in decode attention
over dense (fp32 / bf16) and quantized (int8 / uint4) spans, and gelu_tanh_mul, each against a float64 computation
written here (not only against compute/reference.py), at every ISA level this CPU has."""
from __future__ import annotations

import math
import os

import pytest
import torch

from allspark_server.compute import ops, reference
from allspark_server.compute.steps import Attention
from allspark_server.quant import kv as kv_quant

pytestmark = pytest.mark.skipif(os.environ.get("ALLSPARK_NO_NATIVE") == "1" or ops.native() is None,
                                reason="native kernels not built or disabled")

# the kernel variants: portable, AVX2, AVX-512 (ISA_AVX512_VNNI runs the AVX-512 attention and activations), and
# AVX-512 BF16 (the decode attention's bf16 dot products)
ISAS = [i for i in (ops.ISA_PORTABLE, ops.ISA_AVX2, ops.ISA_AVX512, ops.ISA_AVX512_BF16) if i <= ops.isa_level()]
EPS32 = 2.0 ** -24          # fp32's unit roundoff
EPS_BF16 = 2.0 ** -8        # bf16's (8 significant bits)

# (heads, KV heads, head dim, span size): GQA groups of 4, 3, 8 and 1 heads; head dims 64 / 128 / 256 take the AVX2
# and AVX-512 intrinsics, 48 the AVX-512 ones for dense and int8 spans but the compiled loops for AVX2 and for
# AVX-512 uint4, 24 the compiled loops everywhere
SHAPES = [(8, 2, 64, 16), (12, 4, 128, 32), (4, 1, 256, 16), (16, 2, 128, 16), (6, 2, 48, 16), (3, 3, 24, 8)]
# contexts around the window of 37 (smaller, equal, one more, starting mid-span), span boundaries for 16, long ones
CTX = [1, 5, 36, 37, 38, 48, 53, 100, 257]
WINDOWS = [0, 1, 16, 37, 64, 4096]
SOFTCAPS = [0.0, 30.0, 50.0]


def _cache(mode, dtype, heads, kvh, d, span, g):
    """(q, k, v, k_param, v_param, spans, ctx, scale): each sequence on its own scattered spans; q and k large, so
    the scores reach +-60 (a cap of 30 or 50 changes them, and an uncapped softmax is nearly one-hot)."""
    ctx = torch.tensor(CTX)
    width = -(-max(CTX) // span)
    num_spans = len(CTX) * width + 3
    k = (torch.randn(num_spans, span, kvh, d, generator=g) * 2).to(dtype)
    v = torch.randn(num_spans, span, kvh, d, generator=g).to(dtype)
    k_param = v_param = None
    if mode is not None:
        (k, k_param), (v, v_param) = kv_quant.quantize_rows(k, mode), kv_quant.quantize_rows(v, mode)
    spans = torch.randperm(num_spans - 3, generator=g)[:len(CTX) * width].view(len(CTX), width)   # 3 spans unused
    q = (torch.randn(len(CTX), heads, d, generator=g) * 8).to(dtype)
    return q, k, v, k_param, v_param, spans, ctx, d ** -0.5


def _rows64(cache, param, mode):
    """A cache [S, P, KVH, D or D/2] as float64 rows [S * P, KVH, D]: dense values widened, or codes read back as
    (code - zero) * scale computed in float64."""
    s, p, kvh = cache.shape[:3]
    if mode is None:
        return cache.double().view(s * p, kvh, -1)
    codes = cache.view(s * p, kvh, -1)
    if mode == "uint4":
        codes = torch.cat([codes & 0xF, codes >> 4], -1)
    prm = param.view(s * p, kvh, 2).double()
    return (codes.double() - prm[..., 1:]) * prm[..., :1]


def scores64(q, rows, span, spans, ctx, scale, window=0):
    """Gemma 2's decode attention in float64 up to the scores, per sequence: (its key positions t >= ctx - window,
    scale * q.k [H, m], the values attended [m, H, D]) over `rows` (_rows64 of the keys and the values). Also, per
    sequence, the largest scale * sum_d |q_d k_d| (the size of what the fp32 dots add up) and the largest |v|
    attended. The caps and slopes (attend64) reuse them."""
    kr, vr = rows
    kvh, heads = kr.shape[1], q.shape[1]
    kv_of = torch.arange(heads) // (heads // kvh)
    parts, amax, vmax = [], [], []
    for b in range(q.shape[0]):
        n = int(ctx[b])
        first = max(0, n - window) if window else 0
        t = torch.arange(first, n)
        slots = spans[b, t // span] * span + t % span
        keys, vals = kr[slots][:, kv_of], vr[slots][:, kv_of]                   # [m, H, D]
        qb = q[b].double()
        parts.append((t, torch.einsum("hd,mhd->hm", qb, keys) * scale, vals))
        amax.append((torch.einsum("hd,mhd->hm", qb.abs(), keys.abs()) * scale).max().item())
        vmax.append(vals.abs().max().item())
    return parts, torch.tensor(amax, dtype=torch.float64), torch.tensor(vmax, dtype=torch.float64)


def attend64(parts, ctx, softcap=0.0, slopes=None):
    """The rest in float64: softcap * tanh(scores / softcap), + slope_h * (t - (ctx - 1)), softmax, weights . V."""
    out = []
    for b, (t, s, vals) in enumerate(parts):
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s + slopes.double()[:, None] * (t - (int(ctx[b]) - 1)).double()[None, :]
        out.append(torch.einsum("hm,mhd->hd", torch.softmax(s, -1), vals))
    return torch.stack(out)


def _attend(isa, mode, q, k, v, k_param, v_param, spans, ctx, scale, slopes=None, **kw):
    ext, options = ops.native(), ops.attention_options(scale, **kw)
    if mode is None:
        return ext.decode_attention(q, k, v, spans, ctx, options, isa, slopes)
    return ext.decode_attention_quant(q, k, k_param, v, v_param, spans, ctx, options, isa, slopes)


def _tolerance(dtype, amax, vmax, out64):
    """Per sequence [B, 1, 1]. fp32: the dots' rounding (a few of fp32's roundoffs of the size of what they add,
    amax) shifts the softmax weights by about that much, times the values' size; the cap, exp and the sums add a
    few roundoffs of vmax. bf16 adds the weights rounded to bf16 before meeting V (dense spans) and the output's
    rounding: 2^-8 each of vmax and |out|."""
    fp32 = 4 * EPS32 * (1 + amax) * vmax
    if dtype == torch.bfloat16:
        fp32 = fp32 + EPS_BF16 * vmax + EPS_BF16 * out64.abs().amax((1, 2))
    return fp32[:, None, None]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-p{}".format(*s))
@pytest.mark.parametrize("mode", [None, "int8", "uint4"], ids=["dense", "int8", "uint4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_and_window_match_float64(shape, mode, dtype):
    """Every window (none, 1 key, a span, 37 keys starting mid-span, 64, more than any context) with every cap (none,
    30, 50), with and without ALiBi, at every ISA level: the native kernel agrees with float64 attention over the
    same (dequantized) rows, and so does the torch reference given float64 inputs."""
    heads, kvh, d, span = shape
    g = torch.Generator().manual_seed(SHAPES.index(shape) + 10 * [None, "int8", "uint4"].index(mode))
    q, k, v, k_param, v_param, spans, ctx, scale = _cache(mode, dtype, heads, kvh, d, span, g)
    slopes = torch.rand(heads, generator=g) * 0.5
    capped_moved = 0.0
    rows = _rows64(k, k_param, mode), _rows64(v, v_param, mode)
    for window in WINDOWS:
        parts, amax, vmax = scores64(q, rows, span, spans, ctx, scale, window)
        for softcap in SOFTCAPS:
            for sl in (None, slopes):
                out64 = attend64(parts, ctx, softcap, sl)
                tol = _tolerance(dtype, amax, vmax, out64)
                for isa in ISAS:
                    out = _attend(isa, mode, q, k, v, k_param, v_param, spans, ctx, scale, sl, softcap=softcap,
                                  window=window)
                    assert out.dtype == dtype and out.shape == q.shape
                    err = (out.double() - out64).abs()
                    assert (err <= tol).all(), (isa, window, softcap, sl is not None,
                                                (err / tol).amax((1, 2)).tolist())
                if softcap == 30.0 and sl is None and window == 0:
                    uncapped = attend64(parts, ctx)
                    capped_moved = (out64 - uncapped).abs().max().item()
                # the torch reference, in float64 (quantized spans: rows read back in fp32, then widened)
                ref = reference.decode_attention_reference(q.double(), k.double() if mode is None else k,
                                                           v.double() if mode is None else v, spans, ctx,
                                                           Attention(scale, softcap=softcap, window=window),
                                                           k_param, v_param, sl)
                ref_tol = 1e-10 if mode is None else 4 * EPS32 * (1 + amax.max().item()) * vmax.max().item()
                assert ref.dtype == torch.float64 and (ref - out64).abs().max().item() <= ref_tol
    assert capped_moved > 0.1, "the scores are too small for the cap to matter"


@pytest.mark.parametrize("mode", [None, "int8", "uint4"], ids=["dense", "int8", "uint4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_defaults_are_bit_identical_to_no_arguments(mode, dtype):
    """softcap 0 and window 0 (or a window as long as every context, or longer) give exactly the result of a call
    without them, with and without ALiBi, at every ISA level and head dim path."""
    g = torch.Generator().manual_seed(21)
    for heads, kvh, d, span in SHAPES:
        q, k, v, k_param, v_param, spans, ctx, scale = _cache(mode, dtype, heads, kvh, d, span, g)
        for sl in (None, torch.rand(heads, generator=g) * 0.5):
            for isa in ISAS:
                plain = _attend(isa, mode, q, k, v, k_param, v_param, spans, ctx, scale, sl)
                for kw in ({"softcap": 0.0, "window": 0}, {"softcap": 0.0}, {"window": 0},
                           {"window": int(ctx.max())}, {"window": 1 << 40}):
                    again = _attend(isa, mode, q, k, v, k_param, v_param, spans, ctx, scale, sl, **kw)
                    assert torch.equal(plain, again), (isa, d, kw)


@pytest.mark.parametrize("mode", [None, "int8", "uint4"], ids=["dense", "int8", "uint4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keys_before_the_window_are_not_read(mode, dtype):
    """Every key before a sequence's window is poisoned with NaN (its rows, or its rows' params), and the span ids
    of spans wholly before the window point at a span of NaN: the output is finite and bit-equal to the clean
    cache's. A sequence's result is the same alone as in the batch."""
    g = torch.Generator().manual_seed(33)
    for heads, kvh, d, span in SHAPES[:2] + SHAPES[4:]:
        q, k, v, k_param, v_param, spans, ctx, scale = _cache(mode, dtype, heads, kvh, d, span, g)
        num_spans = k.shape[0]
        nan_span = num_spans - 1                     # _cache leaves the last 3 spans unused
        assert nan_span not in spans
        for window in (1, span, 37, 64):
            pk, pv = k.clone(), v.clone()
            pkp, pvp = (None, None) if mode is None else (k_param.clone(), v_param.clone())
            pspans = spans.clone()
            for b, n in enumerate(CTX):
                first = max(0, n - window)
                for t in range(first):
                    i, o = t // span, t % span
                    if mode is None:
                        pk[spans[b, i], o], pv[spans[b, i], o] = float("nan"), float("nan")
                    else:
                        pkp[spans[b, i], o], pvp[spans[b, i], o] = float("nan"), float("nan")
                pspans[b, :first // span] = nan_span
            if mode is None:
                pk[nan_span], pv[nan_span] = float("nan"), float("nan")
            else:
                pkp[nan_span], pvp[nan_span] = float("nan"), float("nan")
            for isa in ISAS:
                for softcap in (0.0, 30.0):
                    clean = _attend(isa, mode, q, k, v, k_param, v_param, spans, ctx, scale, softcap=softcap,
                                    window=window)
                    poisoned = _attend(isa, mode, q, pk, pv, pkp, pvp, pspans, ctx, scale, softcap=softcap,
                                       window=window)
                    assert torch.isfinite(poisoned).all() and torch.equal(clean, poisoned), (isa, d, window, softcap)
                    for b in (2, 8):
                        alone = _attend(isa, mode, q[b:b + 1], pk, pv, pkp, pvp, pspans[b:b + 1], ctx[b:b + 1],
                                        scale, softcap=softcap, window=window)
                        assert torch.equal(alone[0], clean[b]), (isa, d, window, softcap, b)


def test_bad_softcap_and_window_are_refused():
    q, k, v, k_param, v_param, spans, ctx, scale = _cache(None, torch.float32, 2, 1, 64, 16, torch.Generator())
    for kw in ({"softcap": -1.0}, {"softcap": float("nan")}, {"softcap": float("inf")}, {"window": -1}):
        with pytest.raises(RuntimeError, match="softcap|window"):
            _attend(ops.isa_level(), None, q, k, v, None, None, spans, ctx, scale, **kw)
    qk, kk, vk, kp, vp, *_ = _cache("int8", torch.float32, 2, 1, 64, 16, torch.Generator())
    with pytest.raises(RuntimeError, match="window"):
        _attend(ops.isa_level(), "int8", qk, kk, vk, kp, vp, spans, ctx, scale, window=-3)


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of fp32's spacing at exact (exact float64)."""
    spacing = torch.from_numpy(__import__("numpy").spacing(exact.float().abs().numpy())).double()
    return (got.double() - exact).abs() / spacing


@pytest.mark.parametrize("isa", ISAS)
def test_softcap_tanh_is_accurate_to_a_few_ulp(isa):
    """The soft-capping the attention kernels apply (the vector tanh of simd.h at AVX2 / AVX-512, std::tanh
    portable): tanh over a dense sweep of fp32 values, both branches of the vector tanh and its switch at 0.625,
    within 3 ulp of float64; cap * tanh(x / cap) for caps 30 and 50 within 4; +-inf and huge scores give exactly
    +-cap, NaN stays NaN, -0 stays -0, and lengths off the vector width do their tails the same way."""
    ext = ops.native()
    # every 997th fp32 value in [0, 12] (denormals included), then the negatives, then values around the branch switch
    bits = torch.arange(0, int(torch.tensor(12.0).view(torch.int32)), 997, dtype=torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, -x, torch.linspace(0.62, 0.63, 1001), torch.tensor([1e-30, 1e-40, 9.0, 9.1, 20.0, 44.0])])
    t = ext.softcap_scores(x, 1.0, isa)
    assert _ulps(t, torch.tanh(x.double())).max().item() <= 3
    for cap in (30.0, 50.0):
        s = torch.cat([torch.linspace(-2000, 2000, 200001), torch.randn(10001) * 40])
        got = ext.softcap_scores(s, cap, isa)
        exact = cap * torch.tanh(s.double() / cap)
        assert _ulps(got, exact).max().item() <= 4, cap
        special = ext.softcap_scores(torch.tensor([float("inf"), -float("inf"), 1e30, -3e38, float("nan"), -0.0]),
                                     cap, isa)
        assert special[:4].tolist() == [cap, -cap, cap, -cap]
        assert math.isnan(special[4].item()) and special[5].item() == 0.0 and math.copysign(1, special[5].item()) < 0
    for n in (1, 7, 8, 9, 15, 17, 33):       # the tails agree with the same values inside a long row
        assert torch.equal(ext.softcap_scores(s[:n], 30.0, isa), ext.softcap_scores(s[:64], 30.0, isa)[:n])


def gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    """gelu(x, approximate="tanh") in float64: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# gates whose x^3 is large, or overflows fp32 (1e13, 1e30), near tanh's branch switch (u = 0.625 at x ~ 0.78), tiny
EXTREMES = [0.0, -0.0, 1e4, -1e4, 3e3, -3e3, 100.0, -100.0, 10.0, -10.0, 5.0, -5.0, 3.0, -3.0, 1e-3, -1e-3, 1e-30,
            -1e-30, 0.5, -0.5, 0.78, -0.78, 0.79, -0.79, 4.6e12, -4.6e12, 1e13, -1e13, 1e30, -1e30]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_gelu_tanh_mul_matches_float64_and_hf(dtype, isa):
    """gelu_tanh_mul against float64 for odd widths (vector tails, pieces split over threads) and extreme gates
    (|x| up to 1e4 and beyond, where x^3 is huge or overflows fp32): no NaN; fp32 within a few roundoffs, where
    for x << 0 they are roundoffs of 0.5 |x| (1 + tanh(..) cancels, in ATen's formula as here); bf16 rounds gelu's
    output and then the product, like HF's `gelu_pytorch_tanh(gate) * up`, which it equals but for rare last-bit
    differences wherever the formula is well conditioned (x >= -2; below, both sides round a cancelled difference)."""
    from transformers.activations import ACT2FN
    g = torch.Generator().manual_seed(9)
    ext = ops.native()
    conditioned = differ = 0
    for rows, inter in ((1, 1), (2, 7), (3, 16), (5, 17), (4, 33), (64, 1037), (1, 4096), (2, 9000)):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        extremes = torch.tensor(EXTREMES)
        k = min(inter, len(EXTREMES))
        gate_up[0, :k] = extremes[:k].to(dtype)
        gate_up[-1, inter - k:inter] = extremes[len(EXTREMES) - k:].to(dtype)
        out = ext.gelu_tanh_mul(gate_up, isa)
        assert out.dtype == dtype and out.shape == (rows, inter) and not torch.isnan(out).any()
        gate, up = gate_up.chunk(2, dim=-1)
        gelu = gelu_tanh64(gate)
        exact = gelu * up.double()
        err = (out.double() - exact).abs()
        # fp32 gelu: a few roundoffs of 0.5 |x| (tanh's few ulp, 1 + t, the products) and of the result
        fp32 = 8 * EPS32 * (0.5 * gate.double().abs() + gelu.abs()) * up.double().abs()
        if dtype == torch.float32:
            assert (err <= fp32 + 2 * EPS32 * exact.abs()).all(), (isa, rows, inter)
            continue
        # gelu's output rounded to bf16, then the product: half a bf16 step each
        assert (err <= fp32 + 2 * EPS_BF16 * exact.abs() * (1 + EPS_BF16)).all(), (isa, rows, inter)
        hf = ACT2FN["gelu_pytorch_tanh"](gate) * up
        gap = (out.double() - hf.double()).abs()
        assert (gap <= 2 * EPS_BF16 * 2 * hf.double().abs() + 2 * fp32).all(), (isa, rows, inter)
        well = gate >= -2
        conditioned += well.sum().item()
        differ += (out != hf)[well].sum().item()
    if dtype == torch.bfloat16:
        assert differ <= 2e-3 * conditioned, (differ, conditioned)
    # reference = HF's activation
    x = torch.randn(3, 10, generator=g)
    assert torch.equal(reference.gelu_tanh_mul_reference(x), ACT2FN["gelu_pytorch_tanh"](x[:, :5]) * x[:, 5:])
