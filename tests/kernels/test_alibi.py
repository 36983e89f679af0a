"""ALiBi (allspark_server/compute/alibi.py): the slopes worked by hand, each tensor-parallel rank's share, the prefill
bias of a chunk over cached tokens, and every decode path given slopes against float64 attention written here: the
torch reference, the native kernel at each ISA level over dense and quantized spans, the native attention step
(no rotary) and the DecodeStack. The Triton kernels' ALiBi tests are in test_triton_kernels.py; Baichuan2-13B end to
end in test_model_families.py."""
from __future__ import annotations

import pytest
import torch
from remote_layouts import alibi_slopes as baichuan_slopes

from allspark_client import settings
from allspark_server.compute import alibi, ops, reference, step_ops, steps
from allspark_server.layers.sharding import TPLayout
from allspark_server.models import baichuan
from allspark_server.models.args import ModelArgs
from allspark_server.quant import kv as kv_quant
from allspark_server.step.kv_cache import KVCache

needs_native = pytest.mark.skipif(settings.NO_NATIVE.get() or ops.native() is None,
                                  reason="native path disabled")
ISAS = list(range(ops.isa_level() + 1))
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}   # max |error| (outputs are O(1))


# ---- slopes ---------------------------------------------------------------------------------------------

def test_slopes_by_hand():
    assert alibi.alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    assert alibi.alibi_slopes(4).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    assert alibi.alibi_slopes(1).tolist() == [1 / 256]
    # 12 heads: the 8 slopes of 8 heads, then 2^(-8 (2k + 1) / 16) = 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    twelve = [2.0 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    assert torch.equal(alibi.alibi_slopes(12), torch.tensor(twelve, dtype=torch.float32))
    # Baichuan2-13B's 40 heads: 2^(-(h + 1) / 4) for the first 32, then 2^(-(2k + 1) / 8), k < 8
    forty = [2.0 ** (-(h + 1) / 4) for h in range(32)] + [2.0 ** (-(2 * k + 1) / 8) for k in range(8)]
    assert torch.equal(alibi.alibi_slopes(40), torch.tensor(forty, dtype=torch.float32))


def test_slopes_agree_with_baichuans_get_interleave():
    for n in range(1, 80):
        torch.testing.assert_close(alibi.alibi_slopes(n), torch.tensor(baichuan_slopes(n), dtype=torch.float32),
                                   rtol=1e-7, atol=0)


@pytest.mark.parametrize("heads,world", [(4, 2), (12, 3), (40, 2), (40, 4), (40, 8)])
def test_each_rank_holds_the_slopes_of_its_heads(heads, world):
    parts = []
    for rank in range(world):
        tp = TPLayout(rank, world, heads, heads, 16, 8 * world, 32)
        parts.append(alibi.local_slopes(heads, tp.head_range()))
        assert parts[-1].shape == (tp.local_heads,)
    assert torch.equal(torch.cat(parts), alibi.alibi_slopes(heads))


def test_baichuan_13b_config_reads_as_alibi_and_older_args_as_rope():
    hf = dict(architectures=["BaichuanForCausalLM"], vocab_size=125696, hidden_size=5120, intermediate_size=13696,
              num_hidden_layers=40, num_attention_heads=40, model_max_length=4096, rms_norm_eps=1e-6)
    args = baichuan.read_args(hf, None)
    assert args.position_embedding == "alibi" and args.max_position_embeddings == 4096 and args.lm_head_normalized
    assert baichuan.read_args(dict(hf, max_position_embeddings=4096), None).position_embedding == "rope"
    old = args.to_dict()
    del old["position_embedding"]                 # a model file written before the field existed
    assert ModelArgs.from_dict(old).position_embedding == "rope"


# ---- prefill --------------------------------------------------------------------------------------------

def test_prefill_bias_of_a_chunk_after_cached_tokens():
    bias = alibi.prefill_bias(torch.tensor([0.5, 0.25]), q_len=2, ctx_len=4)     # queries at positions 2 and 3
    inf = float("inf")
    assert torch.equal(bias[0], torch.tensor([[-1.0, -0.5, 0.0, -inf], [-1.5, -1.0, -0.5, 0.0]]))
    assert torch.equal(bias[1], torch.tensor([[-0.5, -0.25, 0.0, -inf], [-0.75, -0.5, -0.25, 0.0]]))


def attention_float64(q, k, v, slopes, scale, positions):
    """q [H, m, D] at `positions`, k/v [KVH, n, D] -> [H, m, D]: softmax over keys j <= i of q.k * scale +
    slope_h * (j - i), times v; float64, one row at a time."""
    group = q.shape[0] // k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        kh, vh = k[h // group].double(), v[h // group].double()
        for r, i in enumerate(positions):
            s = kh[:i + 1] @ q[h, r].double() * scale + float(slopes[h]) * (torch.arange(i + 1.0) - i).double()
            out[h, r] = torch.softmax(s, 0) @ vh[:i + 1]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [alibi.PREFILL_BIAS_BYTES, 1], ids=["one-call", "per-kv-group"])
def test_prefill_attention_with_the_bias(monkeypatch, dtype, budget):
    monkeypatch.setattr(alibi, "PREFILL_BIAS_BYTES", budget)
    g = torch.Generator().manual_seed(3)
    for heads, kvh, d, m, n in ((4, 4, 16, 5, 5), (6, 2, 24, 3, 40), (12, 4, 32, 17, 17), (8, 1, 16, 9, 30)):
        q = torch.randn(1, heads, m, d, generator=g).to(dtype)
        k = torch.randn(1, kvh, n, d, generator=g).to(dtype)
        v = torch.randn(1, kvh, n, d, generator=g).to(dtype)
        slopes = alibi.alibi_slopes(heads)
        out = alibi.prefill_attention(q, k, v, slopes, d ** -0.5)
        want = attention_float64(q[0], k[0], v[0], slopes, d ** -0.5, list(range(n - m, n)))
        assert out.dtype == dtype and out.shape == q.shape
        assert (out[0].double() - want).abs().max().item() <= TOL[dtype], (heads, kvh, d, m, n)


# ---- decode ---------------------------------------------------------------------------------------------

def decode_case(dtype, heads, kvh, d, span_size, g, num_spans=40):
    ctx = torch.tensor([1, 7, span_size, span_size + 1, 150])
    width = -(-int(ctx.max()) // span_size)
    spans = torch.stack([torch.randperm(num_spans, generator=g)[:width] for _ in ctx])   # scattered spans
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    return q, spans, ctx


def dense_cache(dtype, num_spans, span_size, kvh, d, g):
    return (torch.randn(num_spans, span_size, kvh, d, generator=g).to(dtype),
            torch.randn(num_spans, span_size, kvh, d, generator=g).to(dtype))


def decode_float64(q, k_rows, v_rows, spans, ctx, span_size, slopes, scale):
    """k_rows/v_rows(slots) -> [n, KVH, D]; one query per sequence at position ctx - 1 -> [B, H, D] float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        slots = torch.tensor([int(spans[b, t // span_size]) * span_size + t % span_size for t in range(n)])
        k, v = k_rows(slots).transpose(0, 1), v_rows(slots).transpose(0, 1)            # [KVH, n, D]
        out[b] = attention_float64(q[b][:, None], k, v, slopes, scale, [n - 1])[:, 0]
    return out


def dense_rows(cache):
    return lambda slots: cache.reshape(-1, *cache.shape[2:])[slots]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_decode_reference_with_slopes(dtype):
    g = torch.Generator().manual_seed(4)
    for heads, kvh, d, span_size in ((4, 4, 16, 16), (12, 4, 32, 8), (6, 1, 24, 16)):
        k_cache, v_cache = dense_cache(dtype, 40, span_size, kvh, d, g)
        q, spans, ctx = decode_case(dtype, heads, kvh, d, span_size, g)
        slopes = alibi.alibi_slopes(heads)
        out = ops.decode_attention_reference(q, k_cache, v_cache, spans, ctx, steps.Attention(d ** -0.5),
                                              alibi_slopes=slopes)
        want = decode_float64(q, dense_rows(k_cache), dense_rows(v_cache), spans, ctx, span_size, slopes, d ** -0.5)
        assert out.dtype == dtype and (out.double() - want).abs().max().item() <= TOL[dtype]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_native_decode_attention_with_slopes(dtype, isa):
    g = torch.Generator().manual_seed(5)
    ext = ops.native()
    for heads, kvh, d, span_size in ((4, 4, 16, 16), (8, 2, 64, 32), (12, 4, 24, 16), (2, 1, 128, 64)):
        k_cache, v_cache = dense_cache(dtype, 40, span_size, kvh, d, g)
        q, spans, ctx = decode_case(dtype, heads, kvh, d, span_size, g)
        slopes = alibi.alibi_slopes(heads)
        out = ext.decode_attention(q, k_cache, v_cache, spans, ctx, ops.attention_options(d ** -0.5), isa, slopes)
        want = decode_float64(q, dense_rows(k_cache), dense_rows(v_cache), spans, ctx, span_size, slopes, d ** -0.5)
        assert out.dtype == dtype and (out.double() - want).abs().max().item() <= TOL[dtype], (heads, kvh, d)
        plain = ext.decode_attention(q, k_cache, v_cache, spans, ctx, ops.attention_options(d ** -0.5), isa)
        assert (plain.double() - want).abs().max().item() > 0.05          # the bias matters at these lengths
        alone = ext.decode_attention(q[3:4], k_cache, v_cache, spans[3:4], ctx[3:4], ops.attention_options(d ** -0.5),
                                     isa, slopes)
        assert torch.equal(alone[0], out[3])                               # batch neighbours change nothing
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        ext.decode_attention(q, k_cache, v_cache, spans, ctx, ops.attention_options(1.0), isa, slopes[:1])


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", kv_quant.NATIVE_KV_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_attention_over_quantized_spans_with_slopes(isa, mode, dtype):
    g = torch.Generator().manual_seed(6)
    for heads, kvh, d in ((4, 4, 64), (12, 4, 32), (6, 2, 48)):
        span_size, num_spans = 16, 40
        cache = KVCache(1, num_spans, span_size, kvh, d, dtype, mode).layers[0]
        n = num_spans * span_size
        k = (torch.randn(n, kvh, d, generator=g) * 2).to(dtype)
        v = torch.randn(n, kvh, d, generator=g).to(dtype)
        ops.store_kv_reference(k, v, cache.k, cache.v, torch.arange(n), cache.k_param, cache.v_param)
        q, spans, ctx = decode_case(dtype, heads, kvh, d, span_size, g, num_spans)
        slopes = alibi.alibi_slopes(heads)

        def rows(codes, param):
            return lambda slots: kv_quant.dequantize_rows(codes.view(n, kvh, -1)[slots], param.view(n, kvh, 2)[slots],
                                                          mode).double()
        want = decode_float64(q, rows(cache.k, cache.k_param), rows(cache.v, cache.v_param), spans, ctx, span_size,
                              slopes, d ** -0.5)
        out = ops.native().decode_attention_quant(q, cache.k, cache.k_param, cache.v, cache.v_param, spans, ctx,
                                                  ops.attention_options(d ** -0.5), isa, slopes)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert out.dtype == dtype and (out.double() - want).abs().max().item() <= tol, (heads, kvh, d)
        ref = ops.decode_attention_reference(q, cache.k, cache.v, spans, ctx, steps.Attention(d ** -0.5), cache.k_param,
                                             cache.v_param, slopes)
        assert (ref.double() - want).abs().max().item() <= tol


# ---- the attention step and the decode stack, without rotary -------------------------------------------

def _unfused_alibi_attention(h, c, k_cache, v_cache, heads, kv_heads, slopes):
    """The model's unfused op sequence of an ALiBi attention step (no rotary) on normed rows h, each op native
    where it can be."""
    b, d = h.shape[0], k_cache.shape[-1]
    q, k, v = ops.linear(h, c["qkv_w"], c["qkv_b"]).split([heads * d, kv_heads * d, kv_heads * d], -1)
    ops.store_kv(k.view(b, kv_heads, d), v, k_cache, v_cache, c["slots"])
    o = ops.decode_attention(q.view(b, heads, d), k_cache, v_cache, c["spans"], c["ctx"], steps.Attention(c["scale"]),
                             alibi_slopes=slopes)
    return ops.linear(o.reshape(b, heads * d), c["o_w"])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_step_without_rotary(dtype):
    """The native attention step of an ALiBi layer (position "alibi", no cos/sin): bit-equal to the unfused ops,
    the same cache pages written, and (fp32) equal to the reference step."""
    from decode_step_cases import _bound_layer, _decode_layer_case
    g = torch.Generator().manual_seed(7)
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 8, 2, 16, True)):
        c = _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g)
        slopes = alibi.alibi_slopes(heads)
        caches = {name: (c["k_cache"].clone(), c["v_cache"].clone()) for name in ("native", "unfused", "reference")}
        h = ops.rms_norm(c["x"], c["norm1"], c["eps"], c["residual"])[0]
        attention = _bound_layer(c, heads, kv_heads, *caches["native"], alibi_slopes=slopes)[1]
        o = step_ops.attention_step(h, attention, c["slots"], c["spans"], c["ctx"], None, None)
        assert attention.native is not None                                 # it ran the native step
        unfused = _unfused_alibi_attention(h, c, *caches["unfused"], heads, kv_heads, slopes)
        assert torch.equal(o, unfused)
        assert all(torch.equal(a, b) for a, b in zip(caches["native"], caches["unfused"]))
        assert not torch.equal(caches["native"][0], c["k_cache"])          # the new keys were written
        if dtype == torch.float32:   # the reference step on the reference norm
            hr = reference.rms_norm_reference(c["x"], c["norm1"], c["eps"], c["residual"])[0]
            ref_attention = _bound_layer(c, heads, kv_heads, *caches["reference"], alibi_slopes=slopes)[1]
            ref = reference.attention_step_reference(hr, ref_attention, c["slots"], c["spans"], c["ctx"], None, None)
            assert (o - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_with_slopes_equals_the_python_step(dtype):
    """An ALiBi model's stack (no rotary tables): logits and cache pages bit-equal to the Python loop over the
    same bound steps."""
    from decode_step_cases import _bound_layer, _decode_layer_case, _fresh_caches, _python_decode_step
    g = torch.Generator().manual_seed(11)
    vocab = 50
    for rows, heads, kv_heads, d, bias in ((1, 4, 4, 16, False), (3, 6, 2, 24, True)):
        cases = [_decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g) for _ in range(3)]
        first = cases[0]
        hidden = first["x"].shape[1]
        slopes = alibi.alibi_slopes(heads)
        embedding = torch.randn(vocab, hidden, generator=g).to(dtype)
        final_norm = steps.BoundNorm(steps.Norm("norm"), (torch.rand(hidden, generator=g) + 0.5).to(dtype),
                                     first["eps"])
        lm_head = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype)
        ids = torch.randint(0, vocab, (rows,), generator=g)
        stack_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        loop_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        stack = step_ops.decode_stack([_bound_layer(c, heads, kv_heads, k, v, alibi_slopes=slopes)
                                       for c, (k, v) in zip(cases, stack_caches)],
                                      final_norm, embedding, [], lm_head)
        assert stack is not None
        loop_layers = [_bound_layer(c, heads, kv_heads, k, v, alibi_slopes=slopes)
                       for c, (k, v) in zip(cases, loop_caches)]
        expected = _python_decode_step(loop_layers, final_norm, embedding, lm_head, ids, first["ctx"] - 1, first,
                                       None, None)
        _fresh_caches(cases, stack_caches)
        logits = stack.run(ids, first["ctx"] - 1, first["slots"], first["spans"], first["ctx"], None)
        assert torch.equal(logits, expected)
        assert all(torch.equal(a, b) for pair_s, pair_l in zip(stack_caches, loop_caches)
                   for a, b in zip(pair_s, pair_l))
