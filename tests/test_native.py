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
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            y = ops.native().linear_small_m(x, w, isa)
            ref = x.double() @ w.double().T        # the exact product of the same (rounded) inputs
            assert y.dtype == torch.float32 and y.shape == (m, n)
            # fp32 accumulation over k terms: error grows like sqrt(k) * eps * |x||w|
            tol = 1e-5 * (x.double().abs() @ w.double().abs().T).max().item() + 1e-6
            assert (y.double() - ref).abs().max().item() <= tol, (dtype, isa, n, k, m)


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
