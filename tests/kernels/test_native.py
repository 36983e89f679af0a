"""Native kernels against their references: odd shapes, 1..64 rows, every ISA level this CPU has."""
from __future__ import annotations

import pytest
import torch

from allspark_client import settings
from allspark_server.compute import ops, step_ops
from allspark_server.compute.steps import Attention, BoundMlp, Mlp

pytestmark = pytest.mark.skipif(settings.NO_NATIVE.get(), reason="native path disabled")

SHAPES = [(1, 1), (7, 3), (17, 33), (64, 129), (100, 1000), (255, 1537), (513, 4096)]   # (N, K)
ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 31, 64]


def test_native_extension_is_built():
    assert ops.native() is not None, "the native extension failed to build (pip install --no-build-isolation -e .)"


def isa_levels() -> list[int]:
    return list(range(ops.isa_level() + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_linear_small_m_matches_float64(dtype, isa):
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            bias = b if m % 2 else None
            y = ops.native().linear_small_m(x, w, bias, isa)
            ref = x.double() @ w.double().T        # the exact product of the same (rounded) inputs
            if bias is not None:
                ref += bias.double()
            assert y.dtype == dtype and y.shape == (m, n)
            # fp32 accumulation over k terms: error grows like sqrt(k) * eps * |x||w|; then one rounding
            # into the output dtype (half an ulp: at most 2^-8 relative for bf16, 2^-24 for fp32)
            tol = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-6
            rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
            assert ((y.double() - ref).abs() <= tol + rounding).all(), (dtype, isa, n, k, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_linear_small_m_rows_equal_the_rows_alone(dtype, isa):
    """Outside batch-invariant mode too: a speculative verify step's k + 1 rows must come out as one-row steps."""
    assert not ops.native().batch_invariant()
    g = torch.Generator().manual_seed(3)
    for n, k in [(33, 1000), (64, 48), (17, 33), (100, 1537), (9, 576)]:   # K: tails of 8, 16, 1, 1 and none past 32s
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(13, k, generator=g).to(dtype)
        alone = torch.cat([ops.native().linear_small_m(x[i:i + 1], w, None, isa) for i in range(13)])
        for m in (2, 3, 4, 5, 6, 7, 9, 13):
            assert torch.equal(ops.native().linear_small_m(x[:m], w, None, isa), alone[:m]), (dtype, isa, n, k, m)


def _row_xor(rows) -> int:
    """stream_rows' checksum worked by hand: per row, the XOR of its little-endian 8-byte words from the row's
    start, then of its last (row bytes % 8) bytes one at a time; all rows XORed together."""
    out = 0
    for row in rows:
        raw = bytes(row)
        for i in range(0, len(raw) - len(raw) % 8, 8):
            out ^= int.from_bytes(raw[i:i + 8], "little")
        for b in raw[len(raw) - len(raw) % 8:]:
            out ^= b
    return out


@pytest.mark.parametrize("isa", isa_levels())
def test_stream_rows_reads_every_byte_once(isa):
    """The benchmark hook that bounds a GEMV's streaming rate must read exactly the rows (and side rows) given:
    its XOR equals one worked out in Python, for row sizes off the 64-byte step, with and without a side."""
    g = torch.Generator().manual_seed(3)
    for n, cols, side_cols in [(1, 1, 0), (3, 70, 5), (257, 768, 48), (600, 1536, 0), (5, 129, 3)]:
        rows = torch.randint(0, 256, (n, cols), generator=g, dtype=torch.uint8)
        side = torch.randint(0, 256, (n, side_cols), generator=g, dtype=torch.uint8) if side_cols else None
        expected = _row_xor(rows.tolist()) ^ (_row_xor(side.tolist()) if side is not None else 0)
        got = ops.native().stream_rows(rows, side, isa) & (2 ** 64 - 1)
        assert got == expected, (isa, n, cols, side_cols)
    with pytest.raises(RuntimeError, match="side must be"):
        ops.native().stream_rows(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8), isa)
    bf16 = torch.randn(33, 100, generator=g).bfloat16()   # any dtype: its bytes
    assert ops.native().stream_rows(bf16, None, isa) & (2 ** 64 - 1) == _row_xor(bf16.view(torch.uint8).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_linear_dispatch_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 257, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    for m in (1, 3, 4, 5, 16, 17, 40):          # both sides of the native row limit
        x = torch.randn(m, 257, generator=g).to(dtype)
        for bias in (None, b):
            y = ops.linear(x, w, bias)
            ref = ops.linear_reference(x.float(), w.float(), None if bias is None else bias.float())
            assert y.dtype == dtype and y.shape == (m, 300)
            tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
            assert (y.float() - ref).abs().max().item() <= tol
    # non-contiguous weights take the reference path
    wt = torch.randn(257, 300, generator=g).to(dtype).T
    x = torch.randn(2, 257, generator=g).to(dtype)
    assert torch.equal(ops.linear(x, wt), ops.linear_reference(x, wt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_decode_attention_matches_reference(dtype, isa):
    g = torch.Generator().manual_seed(2)
    # head dims of a multiple of 32 (64, 128, 256) take the AVX2 intrinsics, in blocks of up to 4 query heads (G =
    # 2, 3, 4, 6); 16 and 24 the compiled loops. AVX-512: multiples of 16 (16, 48, 64, 128, 256), the value sums in
    # passes of 128 / 64 / 32 / 16 dimensions and blocks of up to 3 heads. AVX-512 BF16 (level 4, bf16 only): multiples
    # of 32 take bf16 dot products (scores 16 keys at a time, values two keys at a time: odd contexts end alone)
    for heads, kv_heads, d, span_size in ((4, 4, 16, 16), (8, 2, 64, 32), (6, 1, 24, 16), (2, 1, 128, 64),
                                          (12, 4, 128, 32), (6, 1, 64, 16), (4, 2, 48, 16), (2, 1, 256, 16)):
        num_spans = 40
        k_cache = torch.randn(num_spans, span_size, kv_heads, d, generator=g).to(dtype)
        v_cache = torch.randn(num_spans, span_size, kv_heads, d, generator=g).to(dtype)
        ctx = torch.tensor([1, 7, span_size, span_size + 1, 300 % (num_spans * span_size // 4) + 2])
        width = -(-int(ctx.max()) // span_size)
        spans = torch.stack([torch.randperm(num_spans, generator=g)[:width] for _ in ctx])   # scattered spans
        q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
        scale = d ** -0.5
        out = ops.native().decode_attention(q, k_cache, v_cache, spans, ctx, ops.attention_options(scale), isa)
        # float64 reference on the same inputs
        ref = ops.decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), spans, ctx,
                                             Attention(scale))
        assert out.dtype == dtype and out.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.double() - ref).abs().max().item() <= tol, (dtype, isa, heads, kv_heads, d)
        # a sequence's result does not depend on the others in the batch
        alone = ops.native().decode_attention(q[3:4], k_cache, v_cache, spans[3:4], ctx[3:4],
                                              ops.attention_options(scale), isa)
        assert torch.equal(alone[0], out[3])


@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("mode", [None, "int8", "uint4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_long_contexts(isa, mode, dtype):
    """Contexts of up to 1029 tokens over 65 scattered spans (the value sums of many keys held in registers,
    attention_common.h), with ALiBi slopes, over dense or quantized spans: float64 attention over the same
    (dequantized) rows agrees, and a sequence's result is the same alone as in the batch."""
    from allspark_server.quant import kv as kv_quant
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, span, num_spans = 6, 2, 64, 16, 80
    k = torch.randn(num_spans, span, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_spans, span, kv_heads, d, generator=g).to(dtype)
    k_param = v_param = None
    if mode is not None:
        (k, k_param), (v, v_param) = kv_quant.quantize_rows(k, mode), kv_quant.quantize_rows(v, mode)
    ctx = torch.tensor([255, 256, 257, 600, 1029, 3])   # 1029 tokens: 65 spans
    spans = torch.stack([torch.randperm(num_spans, generator=g)[:65] for _ in ctx])
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    slopes = torch.rand(heads, generator=g) * 0.05
    scale = d ** -0.5

    def attend(qq, sp, n):
        if mode is None:
            return ops.native().decode_attention(qq, k, v, sp, n, ops.attention_options(scale), isa, slopes)
        return ops.native().decode_attention_quant(qq, k, k_param, v, v_param, sp, n, ops.attention_options(scale),
                                                  isa, slopes)
    out = attend(q, spans, ctx)
    ref = ops.decode_attention_reference(q.double(), k if mode else k.double(), v if mode else v.double(), spans,
                                         ctx, Attention(scale), k_param, v_param, slopes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and (out.double() - ref).abs().max().item() <= tol, (isa, mode, dtype)
    for i in (3, 4):
        assert torch.equal(attend(q[i:i + 1], spans[i:i + 1], ctx[i:i + 1])[0], out[i])


def test_linear_widened_tiles_equal_a_float64_product():
    """linear_widened (prefill GEMMs in fp32 where the bf16 GEMM is slow, and every dequantized one): the weight
    widened a tile of rows at a time, each tile one GEMM into its block of y^T. Against float64 for dense bf16 /
    fp32 weights and a quantized one, with bias, over whole and partial tiles (2 MiB of fp32 rows: 512 rows at K
    = 1024)."""
    from allspark_server.quant.formats import QuantizedWeight, quantize
    ext, g = ops.native(), torch.Generator().manual_seed(11)
    x = torch.randn(37, 1024, generator=g)
    b = torch.randn(600, generator=g)
    w = torch.randn(600, 1024, generator=g) * 0.05
    q = quantize(w, "uint4", 64)
    qw = QuantizedWeight(q["qweight"], q["scales"], q["zeros"], "uint4", 64, 1024)
    cases = ((x, w, b), (x.bfloat16(), w.bfloat16(), b.bfloat16()), (x, ops.native_weight(qw), b))
    for (xs, ws, bs), w64 in zip(cases, (w.double(), w.bfloat16().double(), qw.dequantize().double())):
        y = ext.linear_widened(xs, ws, bs, ops.isa_level())
        ref = xs.double() @ w64.T + bs.double()
        assert y.dtype == xs.dtype and y.shape == (37, 600)
        tol = 1e-4 if xs.dtype == torch.float32 else 2 ** -8 * ref.abs().max().item()
        assert (y.double() - ref).abs().max().item() <= tol, xs.dtype
    with pytest.raises(RuntimeError, match="linear_widened"):
        ext.linear_widened(x[:, :100], w, None, ops.isa_level())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_rms_norm_matches_float64_and_rounds_like_hf(dtype, isa):
    g = torch.Generator().manual_seed(3)
    eps = 1e-6
    for rows, hidden in ((1, 1), (1, 7), (3, 64), (5, 1537), (64, 896), (300, 33), (1, 1536), (2, 4100)):
        x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
        res = torch.randn(rows, hidden, generator=g).to(dtype)
        w = torch.rand(hidden, generator=g).to(dtype) + 0.5
        for residual in (None, res):
            out, s = ops.native().rms_norm(x, w, eps, residual, isa)
            assert out.dtype == dtype and out.shape == x.shape and s.shape == x.shape
            # the sum: exactly x + residual in the activation dtype (one rounding, as torch's add)
            assert torch.equal(s, x if residual is None else x + residual)
            # float64 reference from the same (rounded) sum: statistics exact, then HF's two roundings
            sd = s.double()
            normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)
            if dtype == torch.float32:
                assert (out.double() - w.double() * normed).abs().max().item() <= 1e-5
            else:
                # fp32 statistics may move the normalized value across a bf16 rounding boundary: at most 1 ulp
                # there, so both steps together stay within 2 ulp (2^-6 relative) of the exact value
                exact = w.double() * normed
                assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -6 + 1e-30).all()
                ref, _ = ops.rms_norm_reference(x, w, eps, residual)   # HF's own op sequence
                assert (out != ref).float().mean().item() <= 0.01, "differs from HF's rounding on >1% of values"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_rotary_equals_transformers(dtype, isa):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(4)
    for tokens, heads, kv_heads, d in ((1, 1, 1, 2), (3, 4, 2, 16), (17, 12, 4, 128), (64, 6, 1, 24), (5, 3, 1, 96),
                                       (2, 2, 2, 64)):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
        q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)   # views, as the model passes them
        q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
        angles = torch.rand(tokens, d // 2, generator=g) * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]   # [T, 1, D]
        qo, ko = ops.native().rotary(q, k, cos, sin, isa)
        # transformers' own function on [1, heads, T, D] tensors
        q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None, :, 0],
                                          sin[None, :, 0])
        assert torch.equal(qo, q_hf[0].transpose(0, 1)) and torch.equal(ko, k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_silu_mul_matches_transformers_mlp_activation(dtype, isa):
    from transformers.activations import ACT2FN
    g = torch.Generator().manual_seed(5)
    for rows, inter in ((1, 1), (2, 15), (3, 16), (5, 17), (64, 1037), (1, 4096)):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gate_up[0, :min(inter, 6)] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e4, -1e4])[:min(inter, 6)].to(dtype)
        out = ops.native().silu_mul(gate_up, isa)
        gate, up = gate_up.chunk(2, dim=-1)
        hf = ACT2FN["silu"](gate) * up                      # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
        assert out.dtype == dtype and out.shape == (rows, inter) and torch.isfinite(out).all()
        exact = torch.nn.functional.silu(gate.double()) * up.double()
        if dtype == torch.float32:
            assert ((out.double() - exact).abs() <= exact.abs() * 1e-6 + 1e-30).all()
        else:
            # silu's result is rounded to bf16 before the product, as in HF: compare with HF itself; a last-bit
            # difference in fp32 exp may flip a rounding, so allow a rare 1-ulp (2^-7 relative) difference
            differ = out != hf
            assert differ.float().mean().item() <= 1e-3
            assert ((out.double() - hf.double()).abs() <= hf.double().abs() * 2.0 ** -7).all()


def test_store_kv_writes_each_slot():
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.zeros(9, 16, 2, 24, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        qkv = torch.randn(5, (6 + 2 * 2) * 24, generator=g).to(dtype)
        k = qkv[:, 6 * 24:8 * 24].reshape(5, 2, 24).contiguous()
        v = qkv[:, 8 * 24:]                                  # a strided view, as in the model
        slots = torch.randperm(9 * 16, generator=g)[:5]
        ops.native().store_kv(k, v, k_cache, v_cache, slots)
        k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        ops.store_kv_reference(k, v, k_ref, v_ref, slots)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        assert k_cache.flatten(0, 1)[slots].abs().sum() > 0
        with pytest.raises(RuntimeError, match="outside the cache"):
            ops.native().store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 9 * 16]))


def test_bf16_gemm_of_many_rows_is_widened_without_bf16_dot_products(monkeypatch):
    """Prefill-sized bf16 GEMMs: without bf16 dot products (AVX-512 bf16) oneDNN's bf16 GEMM is ~5x slower than
    fp32 (on the AVX2 VM the 0.5 B benchmark model's 128-token TTFT took 9.6 s in bf16, 2.8 s widened), so x, the
    weight and the bias are widened to fp32 and the result rounded once to bf16; with them the bf16 GEMM runs.
    ops.linear decides from the CPU flags (patched here both ways); the native MLP step decides alike (checked on
    this CPU)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 1024, generator=g).bfloat16()
    w = (torch.randn(96, 1024, generator=g) * 0.05).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    real, seen = F.linear, []
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(x.dtype) or real(x, w, b))
    monkeypatch.setattr(ops, "cpu_flags", lambda: frozenset({"avx2"}))
    y, fp32 = ops.linear(x, w, b), real(x.float(), w.float(), b.float())
    assert seen == [] and y.dtype == torch.bfloat16   # no bf16 GEMM: the native widened one (linear_widened)
    assert ((y.float() - fp32).abs() <= fp32.abs() * 2 ** -8 + 1e-6).all()   # fp32 sums rounded once to bf16
    monkeypatch.setattr(ops, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    seen.clear()
    assert torch.equal(ops.linear(x, w, b), real(x, w, b)) and seen == [torch.bfloat16]
    monkeypatch.undo()

    # the native MLP step with more rows than its GEMV takes: widened exactly where the CPU lacks them
    norm = torch.ones(1024).bfloat16()
    gate_up = (torch.randn(2 * 512, 1024, generator=g) * 0.05).bfloat16()
    down = (torch.randn(1024, 512, generator=g) * 0.05).bfloat16()
    h, _ = ops.rms_norm_reference(x, norm, 1e-6, None)      # the MLP's input: normed rows, as in a layer

    def mlp(gemm):
        return gemm(ops.silu_mul_reference(gemm(h, gate_up)), down)
    widened = mlp(lambda a, m: ops.native().linear_widened(a, m, None, ops.isa_level()))
    in_bf16 = mlp(lambda a, m: real(a, m))
    assert not torch.equal(widened, in_bf16)   # the two GEMMs are told apart by these shapes
    step = step_ops.native_step(BoundMlp(Mlp("silu"), gate_up, None, down))
    out = ops.native().mlp_step(h, step, ops.isa_level(), 0)    # native_rows 0: no row count takes the native GEMV
    bf16_dots = ops.gemm_dtype(torch.bfloat16) == torch.bfloat16
    assert torch.equal(out, in_bf16 if bf16_dots else widened), bf16_dots
