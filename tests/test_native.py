"""Native kernels against their references: odd shapes, 1..64 rows, every ISA level this CPU has."""
from __future__ import annotations

import pytest
import torch

from allspark_client import settings
from allspark_server.compute import ops, reference, step_ops
from allspark_server.compute import steps

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
    # passes of 128 / 64 / 32 / 16 dimensions and blocks of up to 3 heads
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
        out = ops.native().decode_attention(q, k_cache, v_cache, spans, ctx, scale, isa)
        # float64 reference on the same inputs
        ref = ops.decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), spans, ctx, scale)
        assert out.dtype == dtype and out.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.double() - ref).abs().max().item() <= tol, (dtype, isa, heads, kv_heads, d)
        # a sequence's result does not depend on the others in the batch
        alone = ops.native().decode_attention(q[3:4], k_cache, v_cache, spans[3:4], ctx[3:4], scale, isa)
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
            return ops.native().decode_attention(qq, k, v, sp, n, scale, isa, slopes)
        return ops.native().decode_attention_quant(qq, k, k_param, v, v_param, sp, n, scale, isa, slopes)
    out = attend(q, spans, ctx)
    ref = ops.decode_attention_reference(q.double(), k if mode else k.double(), v if mode else v.double(), spans,
                                         ctx, scale, k_param, v_param, slopes)
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


def _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g):
    hidden, inter, span_size, num_spans = heads * d + 8, 3 * d + 5, 16, 24

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    ctx = torch.tensor([1, 17, 33, 5, 60, 2, 31, 16, 9, 40][:rows])
    spans = torch.stack([torch.randperm(num_spans, generator=g)[:4] for _ in range(rows)])
    slots = torch.stack([spans[b, (c - 1) // span_size] * span_size + (c - 1) % span_size for b, c in enumerate(ctx)])
    angles = torch.rand(rows, d // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    return dict(
        x=rand(rows, hidden), residual=rand(rows, hidden), norm1=rand(hidden).abs() + 0.5,
        norm2=rand(hidden).abs() + 0.5, eps=1e-6, qkv_w=rand((heads + 2 * kv_heads) * d, hidden, scale=0.2),
        qkv_b=rand((heads + 2 * kv_heads) * d) if bias else None, o_w=rand(hidden, heads * d, scale=0.2),
        gate_up_w=rand(2 * inter, hidden, scale=0.2), gate_up_b=rand(2 * inter) if bias else None,
        down_w=rand(hidden, inter, scale=0.2), k_cache=rand(num_spans, span_size, kv_heads, d),
        v_cache=rand(num_spans, span_size, kv_heads, d), cos=emb.cos().to(dtype)[:, None],
        sin=emb.sin().to(dtype)[:, None], slots=slots, spans=spans, ctx=ctx, scale=d ** -0.5)


def _bound_layer(c, heads, kv_heads, k_cache, v_cache, alibi_slopes=None):
    """The case's layer as its layer description binds it (compute/steps.py): pre-norm, attention (rotary, or
    ALiBi where slopes are given), pre-norm, silu MLP, over the caches given."""
    attention = steps.Attention(scale=c["scale"], qkv_bias=c["qkv_b"] is not None,
                                position="rope" if alibi_slopes is None else "alibi")
    return [steps.BoundNorm(steps.Norm("input_layernorm"), c["norm1"], c["eps"]),
            steps.BoundAttention(attention, c["qkv_w"], c["qkv_b"], c["o_w"], heads, kv_heads, k_cache, v_cache,
                                 alibi_slopes=alibi_slopes),
            steps.BoundNorm(steps.Norm("post_attention_layernorm"), c["norm2"], c["eps"]),
            steps.BoundMlp(steps.Mlp(), c["gate_up_w"], c["gate_up_b"], c["down_w"])]


def _unfused_attention(h, c, k_cache, v_cache, heads, kv_heads):
    """The model's unfused op sequence of the attention step on normed rows h (each op native where it can be)."""
    b, d = h.shape[0], k_cache.shape[-1]
    q, k, v = ops.linear(h, c["qkv_w"], c["qkv_b"]).split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k = ops.rotary(q.view(b, heads, d), k.view(b, kv_heads, d), c["cos"], c["sin"])
    ops.store_kv(k, v, k_cache, v_cache, c["slots"])
    o = ops.decode_attention(q, k_cache, v_cache, c["spans"], c["ctx"], c["scale"])
    return ops.linear(o.reshape(b, heads * d), c["o_w"])


def _native_norm(x, residual, b):
    """The native NormStep (what the DecodeStack runs) directly: (normed, residual stream)."""
    return ops.native().norm_step(x, residual, step_ops.native_step(b), ops.isa_level())


def _python_decode_step(layers, final_norm, embedding, lm_head, ids, positions, c, cos_table, sin_table,
                        reduce=None, embed_scale=None):
    """A decode step as DecoderForCausalLM runs it without the DecodeStack, over the same bound steps: embedding
    rows (times embed_scale in their dtype), rope rows, each layer's steps through step_ops (each native where it
    can be) with reduce(partial, layer, part) after each sublayer, final norm, LM head -> fp32 logits."""
    x = torch.nn.functional.embedding(ids, embedding)
    if embed_scale is not None:
        x = x * torch.tensor(embed_scale, dtype=x.dtype)
    cos = sin = None
    if cos_table is not None:
        cos, sin = (t[positions].to(x.dtype).unsqueeze(1) for t in (cos_table, sin_table))
    residual = None
    for i, layer in enumerate(layers):
        part = 0
        for b in layer:
            if isinstance(b, steps.BoundNorm):
                x, residual = step_ops.norm_step(x, residual, b)
                continue
            if isinstance(b, steps.BoundAttention):
                x = step_ops.attention_step(x, b, c["slots"], c["spans"], c["ctx"], cos, sin)
            else:
                x = step_ops.mlp_step(x, b)
            x = x if reduce is None else reduce(x, i, part)
            part += 1
    return ops.linear(step_ops.norm_step(x, residual, final_norm)[0], lm_head).float()


def _fresh_caches(cases, caches):
    """Every layer's cache pages back to the case's starting pages (in place: the bound steps hold them)."""
    for c, (k, v) in zip(cases, caches):
        k.copy_(c["k_cache"])
        v.copy_(c["v_cache"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_steps_equal_the_unfused_ops(dtype):
    """The native steps call the same kernels in the same order: the norm step bit-equal to ops.rms_norm, the
    attention step (and the cache pages it writes) and the MLP step bit-equal to the unfused sequence, for row
    counts on both sides of the native-GEMV limit; and (fp32) equal to the pure-torch reference steps."""
    g = torch.Generator().manual_seed(7)
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (6, 4, 4, 32, False),
                                           (9, 8, 2, 16, True)):
        c = _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g)
        caches = {name: (c["k_cache"].clone(), c["v_cache"].clone()) for name in ("native", "unfused", "reference")}
        norm1, attention, norm2, mlp_step = _bound_layer(c, heads, kv_heads, *caches["native"])
        h, s = step_ops.norm_step(c["x"], c["residual"], norm1)
        native_h, native_s = _native_norm(c["x"], c["residual"], norm1)
        want_h, want_s = ops.rms_norm(c["x"], c["norm1"], c["eps"], c["residual"])
        assert torch.equal(h, want_h) and torch.equal(s, want_s)
        assert torch.equal(native_h, want_h) and torch.equal(native_s, want_s)
        o = step_ops.attention_step(h, attention, c["slots"], c["spans"], c["ctx"], c["cos"], c["sin"])
        assert attention.native is not None                                 # it ran the native step
        unfused = _unfused_attention(h, c, *caches["unfused"], heads, kv_heads)
        assert torch.equal(o, unfused)
        assert all(torch.equal(a, b) for a, b in zip(caches["native"], caches["unfused"]))
        assert not torch.equal(caches["native"][0], c["k_cache"])          # the new keys were written

        h2, s2 = step_ops.norm_step(o, s, norm2)
        mlp = step_ops.mlp_step(h2, mlp_step)
        assert mlp_step.native is not None
        assert torch.equal(mlp, ops.linear(ops.silu_mul(ops.linear(h2, c["gate_up_w"], c["gate_up_b"])),
                                           c["down_w"]))
        assert all(torch.equal(a, b) for a, b in zip(_native_norm(o, s, norm2), (h2, s2)))
        # a sandwich norm (no residual add): the stream passes through untouched
        sandwich = steps.BoundNorm(steps.Norm("post_attention_layernorm", adds_residual=False), c["norm2"], c["eps"])
        normed, stream = _native_norm(o, s, sandwich)
        assert torch.equal(normed, ops.rms_norm(o, c["norm2"], c["eps"])[0]) and torch.equal(stream, s)
        assert all(torch.equal(a, b) for a, b in zip(step_ops.norm_step(o, s, sandwich), (normed, s)))

        if dtype == torch.float32:   # the reference steps on the reference norms
            hr, sr = reference.rms_norm_reference(c["x"], c["norm1"], c["eps"], c["residual"])
            ref_attention = _bound_layer(c, heads, kv_heads, *caches["reference"])[1]
            ref = reference.attention_step_reference(hr, ref_attention, c["slots"], c["spans"], c["ctx"], c["cos"],
                                                     c["sin"])
            assert (o - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
            h2r = reference.rms_norm_reference(o, c["norm2"], c["eps"], s)[0]
            ref_mlp = reference.mlp_step_reference(h2r, mlp_step)
            assert (mlp - ref_mlp).abs().max().item() <= 1e-4 * max(1.0, ref_mlp.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_equals_the_python_step(dtype):
    """DecodeStack.run (a whole decode step in one native call) gives bit-equal logits, and writes the same
    cache pages, as the Python path over the same bound steps: embedding and rope rows, the loop over the steps,
    final norm, LM head; with no reduce and with a reduce callable (called in layer order, o projection then down
    projection); an exception raised by the callable reaches the caller."""
    g = torch.Generator().manual_seed(11)
    vocab, max_pos = 50, 64
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 8, 2, 16, False)):
        cases = [_decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g) for _ in range(3)]
        first = cases[0]
        hidden = first["x"].shape[1]
        embedding = torch.randn(vocab, hidden, generator=g).to(dtype)
        angles = torch.rand(max_pos, d // 2, generator=g) * 50
        cos_table, sin_table = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        final_norm = steps.BoundNorm(steps.Norm("norm"), (torch.rand(hidden, generator=g) + 0.5).to(dtype),
                                     first["eps"])
        lm_head = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype)
        ids = torch.randint(0, vocab, (rows,), generator=g)
        positions = first["ctx"] - 1

        stack_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        loop_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        stack = step_ops.decode_stack([_bound_layer(c, heads, kv_heads, k, v)
                                       for c, (k, v) in zip(cases, stack_caches)],
                                      final_norm, embedding, [(cos_table, sin_table)], lm_head)
        assert stack is not None and stack.num_layers == 3
        loop_layers = [_bound_layer(c, heads, kv_heads, k, v) for c, (k, v) in zip(cases, loop_caches)]

        def scaled(t, layer, part):          # stands in for an allreduce: any function of (partial, layer, part)
            calls.append((layer, part))
            return t * (2 + layer + part)

        for reduce in (None, scaled):
            calls = []
            _fresh_caches(cases, loop_caches)
            expected = _python_decode_step(loop_layers, final_norm, embedding, lm_head, ids, positions, first,
                                           cos_table, sin_table, reduce)
            expected_calls, calls = calls, []
            _fresh_caches(cases, stack_caches)                  # the same starting pages as the loop's
            logits = stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], reduce)
            assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
            assert torch.equal(logits, expected)
            assert all(torch.equal(a, b) for pair_s, pair_l in zip(stack_caches, loop_caches)
                       for a, b in zip(pair_s, pair_l))
            assert calls == expected_calls == ([] if reduce is None else [(i, p) for i in range(3) for p in (0, 1)])

        def failing(t, layer, part):
            raise ValueError(f"reduce failed at layer {layer}")
        with pytest.raises(ValueError, match="reduce failed at layer 0"):
            stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], failing)


def _gemma_layer(c, layer, heads, kv_heads, k_cache, v_cache):
    """A Gemma 2 decoder layer's steps over the case's tensors (norm3, norm4: its two sandwich norms): pre-norm,
    attention (scores soft-capped at 10, a sliding window of 8 keys on even layers, a scale other than
    head_dim ** -0.5), the post-attention sandwich norm (no residual add), the pre-MLP norm, the GELU-tanh MLP,
    the post-MLP sandwich norm."""
    attention = steps.Attention(scale=1.5 * c["scale"], qkv_bias=c["qkv_b"] is not None, softcap=10.0,
                                window=8 if layer % 2 == 0 else 0)
    return [steps.BoundNorm(steps.Norm("input_layernorm"), c["norm1"], c["eps"]),
            steps.BoundAttention(attention, c["qkv_w"], c["qkv_b"], c["o_w"], heads, kv_heads, k_cache, v_cache),
            steps.BoundNorm(steps.Norm("post_attention_layernorm", adds_residual=False), c["norm3"], c["eps"]),
            steps.BoundNorm(steps.Norm("pre_feedforward_layernorm"), c["norm2"], c["eps"]),
            steps.BoundMlp(steps.Mlp(act="gelu_tanh"), c["gate_up_w"], c["gate_up_b"], c["down_w"]),
            steps.BoundNorm(steps.Norm("post_feedforward_layernorm", adds_residual=False), c["norm4"], c["eps"])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_runs_a_gemma_layer_as_the_python_step(dtype):
    """The stack runs whatever steps a layer is described as, not one fixed layer shape: Gemma 2's six steps
    (sandwich NormSteps without the residual add after the attention and after the MLP, an MlpStep with
    GELU-tanh, soft-capped and windowed attention) and its scaled embeddings give logits and cache pages bit-equal
    to the Python loop over step_ops on the same bound steps; reduce is called once per sublayer (the norms are
    not parts)."""
    g = torch.Generator().manual_seed(13)
    vocab, max_pos = 50, 64
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 8, 2, 16, False)):
        cases = [_decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g) for _ in range(3)]
        first = cases[0]
        hidden = first["x"].shape[1]
        for c in cases:
            c["norm3"], c["norm4"] = ((torch.rand(hidden, generator=g) + 0.5).to(dtype) for _ in range(2))
        embed_scale = hidden ** 0.5                                         # Gemma's sqrt(hidden)
        embedding = (torch.randn(vocab, hidden, generator=g) / embed_scale).to(dtype)
        angles = torch.rand(max_pos, d // 2, generator=g) * 50
        cos_table, sin_table = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        final_norm = steps.BoundNorm(steps.Norm("norm"), (torch.rand(hidden, generator=g) + 0.5).to(dtype),
                                     first["eps"])
        lm_head = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype)
        ids = torch.randint(0, vocab, (rows,), generator=g)
        positions = first["ctx"] - 1

        stack_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        loop_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        stack = step_ops.decode_stack([_gemma_layer(c, i, heads, kv_heads, k, v)
                                       for i, (c, (k, v)) in enumerate(zip(cases, stack_caches))],
                                      final_norm, embedding, [(cos_table, sin_table)], lm_head,
                                      embed_scale)
        assert stack is not None and stack.num_layers == 3
        loop_layers = [_gemma_layer(c, i, heads, kv_heads, k, v)
                       for i, (c, (k, v)) in enumerate(zip(cases, loop_caches))]

        def scaled(t, layer, part):
            calls.append((layer, part))
            return t * (2 + layer + part)

        for reduce in (None, scaled):
            calls = []
            _fresh_caches(cases, loop_caches)
            expected = _python_decode_step(loop_layers, final_norm, embedding, lm_head, ids, positions, first,
                                           cos_table, sin_table, reduce, embed_scale)
            if reduce is None:
                unreduced = expected
            expected_calls, calls = calls, []
            _fresh_caches(cases, stack_caches)
            logits = stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], reduce)
            assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
            assert torch.equal(logits, expected)
            assert all(torch.equal(a, b) for pair_s, pair_l in zip(stack_caches, loop_caches)
                       for a, b in zip(pair_s, pair_l))
            assert calls == expected_calls == ([] if reduce is None else [(i, p) for i in range(3) for p in (0, 1)])
        # the sandwich norms are applied: the same steps without them give other logits
        plain = [[b for b in layer if not (isinstance(b, steps.BoundNorm) and not b.step.adds_residual)]
                 for layer in loop_layers]
        _fresh_caches(cases, loop_caches)
        assert not torch.equal(_python_decode_step(plain, final_norm, embedding, lm_head, ids, positions, first,
                                                   cos_table, sin_table, None, embed_scale), unreduced)


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
    step = ops.native().MlpStep(gate_up=gate_up, gate_up_bias=None, down=down, act=0)       # silu
    out = ops.native().mlp_step(h, step, ops.isa_level(), 0)    # native_rows 0: no row count takes the native GEMV
    bf16_dots = ops.gemm_dtype(torch.bfloat16) == torch.bfloat16
    assert torch.equal(out, in_bf16 if bf16_dots else widened), bf16_dots
