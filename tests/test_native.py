"""Native kernels against their references: odd shapes, 1..64 rows, every ISA level this CPU has."""
from __future__ import annotations

import os

import pytest
import torch

from allspark_server import ops

pytestmark = pytest.mark.skipif(os.environ.get("ALLSPARK_NO_NATIVE") == "1", reason="native path disabled")

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
    for heads, kv_heads, d, span_size in ((4, 4, 16, 16), (8, 2, 64, 32), (6, 1, 24, 16), (2, 1, 128, 64)):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64_and_rounds_like_hf(dtype):
    g = torch.Generator().manual_seed(3)
    eps = 1e-6
    for rows, hidden in ((1, 1), (1, 7), (3, 64), (5, 1537), (64, 896), (300, 33)):
        x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
        res = torch.randn(rows, hidden, generator=g).to(dtype)
        w = torch.rand(hidden, generator=g).to(dtype) + 0.5
        for residual in (None, res):
            out, s = ops.native().rms_norm(x, w, eps, residual)
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
def test_rotary_equals_transformers(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(4)
    for tokens, heads, kv_heads, d in ((1, 1, 1, 2), (3, 4, 2, 16), (17, 12, 4, 128), (64, 6, 1, 24)):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
        q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)   # views, as the model passes them
        q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
        angles = torch.rand(tokens, d // 2, generator=g) * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]   # [T, 1, D]
        qo, ko = ops.native().rotary(q, k, cos, sin)
        # transformers' own function on [1, heads, T, D] tensors
        q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None, :, 0],
                                          sin[None, :, 0])
        assert torch.equal(qo, q_hf[0].transpose(0, 1)) and torch.equal(ko, k_hf[0].transpose(0, 1))
