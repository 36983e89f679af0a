"""The native prefill attention (native/prefill_attention.cpp) against a float64 computation of causal attention, at
every ISA level this CPU has of the two it is written for (AVX2, AVX-512): a prompt chunk's rows over its context
scattered through the span cache, chunks that follow a cached prefix, GQA ratios from 1 to 7, every head dim it takes,
row and key counts off its blocks; and ops.prefill_attention taking it for a step's chunks."""
from __future__ import annotations

import pytest
import torch

from allspark_server.compute import ops
from allspark_server.compute.reference import prefill_attention_reference
from allspark_server.compute.steps import Attention
from allspark_server.step.inputs import SeqAttention

EXT = ops.native()
pytestmark = pytest.mark.skipif(EXT is None or ops.isa_level() < ops.ISA_AVX2,
                                reason="the native prefill attention needs AVX2 or AVX-512")
# AVX2 (Narrow) and, where the CPU has it, AVX-512 (Wide)
LEVELS = [level for level in (ops.ISA_AVX2, ops.ISA_AVX512) if level <= ops.isa_level()]
SPAN = 8
# fp32: summation-order differences; bf16: one rounding of the output (|out| < ~3, bf16's relative step 2^-8)
TOL = {torch.float32: 5e-6, torch.bfloat16: 2e-2}


def causal_attention_f64(q, k_cache, v_cache, slots, scale):
    """q [T, H, D], row i at position ctx - T + i, over keys 0 .. ctx - T + i of cache slots [ctx], in float64."""
    T, H, D = q.shape
    kvh, ctx = k_cache.shape[2], slots.shape[0]
    k = k_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, 1)
    v = v_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, 1)
    s = torch.einsum("thd,chd->htc", q.double(), k) * scale
    hidden = torch.arange(ctx)[None, :] > torch.arange(ctx - T, ctx)[:, None]
    return torch.einsum("htc,chd->thd", torch.softmax(s.masked_fill(hidden, float("-inf")), -1), v)


def make_case(T, ctx, H, KVH, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    spans = -(-ctx // SPAN) + 3
    k_cache = torch.randn(spans, SPAN, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(spans, SPAN, KVH, D, generator=g).to(dtype)
    order = torch.randperm(spans, generator=g)   # the context's spans scattered through the cache
    slots = (order[:, None] * SPAN + torch.arange(SPAN)[None]).reshape(-1)[:ctx]
    q = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    return q, k_cache, v_cache, slots


@pytest.mark.parametrize("isa", LEVELS, ids=lambda level: f"isa{level}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, ctx, H, KVH, D", [
    (1, 1, 2, 1, 16),        # one row, one key
    (5, 5, 4, 2, 16),        # fewer rows than a block
    (37, 100, 12, 4, 128),   # a chunk after a cached prefix, the benchmark model's heads
    (64, 64, 8, 8, 64),      # no GQA
    (3, 200, 14, 2, 64),     # 7 query heads a KV head
    (130, 130, 6, 1, 96),    # every query head on one KV head
    (33, 70, 4, 4, 256),
    (9, 41, 6, 2, 80),
    (40, 40, 4, 2, 32),
])
def test_equals_float64_causal_attention(T, ctx, H, KVH, D, dtype, isa):
    q, k_cache, v_cache, slots = make_case(T, ctx, H, KVH, D, dtype)
    out = torch.full_like(q, float("nan"))
    EXT.prefill_attention(q, k_cache, v_cache, slots, out, D ** -0.5, isa)
    want = causal_attention_f64(q, k_cache, v_cache, slots, D ** -0.5)
    err = (out.double() - want).abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("isa", LEVELS, ids=lambda level: f"isa{level}")
def test_a_rows_result_does_not_depend_on_the_chunks_other_rows(isa):
    """Row i of a 50-row chunk equals the same query as the only row of a chunk ending at its position."""
    q, k_cache, v_cache, slots = make_case(50, 80, 12, 4, 128, torch.bfloat16, seed=3)
    out = torch.empty_like(q)
    EXT.prefill_attention(q, k_cache, v_cache, slots, out, 0.1, isa)
    for i in (0, 17, 49):
        alone = torch.empty_like(q[i:i + 1])
        EXT.prefill_attention(q[i:i + 1].contiguous(), k_cache, v_cache, slots[:80 - 50 + i + 1], alone, 0.1, isa)
        assert torch.equal(alone[0], out[i])


def test_bad_calls_are_refused_naming_the_problem():
    q, k_cache, v_cache, slots = make_case(4, 4, 4, 2, 16, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="ISA level"):
        EXT.prefill_attention(q, k_cache, v_cache, slots, out, 0.25, ops.ISA_PORTABLE)
    with pytest.raises(RuntimeError, match="dtype"):
        EXT.prefill_attention(q.bfloat16(), k_cache, v_cache, slots, out, 0.25, ops.isa_level())
    with pytest.raises(RuntimeError, match="slots"):
        EXT.prefill_attention(q, k_cache, v_cache, slots[:2], out, 0.25, ops.isa_level())
    assert not EXT.prefill_attention_supports(24) and not EXT.prefill_attention_supports(112)
    q, k_cache, v_cache, slots = make_case(4, 4, 2, 1, 48, torch.float32)
    with pytest.raises(RuntimeError, match="head dim 48"):
        EXT.prefill_attention(q, k_cache, v_cache, slots, torch.empty_like(q), 0.25, ops.isa_level())


def test_ops_prefill_attention_takes_it_for_a_steps_chunks(monkeypatch):
    """Two chunks in one step (one after a cached prefix): ops.prefill_attention calls the native kernel for each,
    and the step's rows equal ATen's SDPA path (compute/reference.py) to fp32 rounding."""
    H, KVH, D = 6, 2, 64
    q1, k_cache, v_cache, slots1 = make_case(20, 20, H, KVH, D, torch.float32, seed=5)
    slots2 = torch.arange(150, 150 + 45)                 # a second sequence: its last 12 of 45 positions
    q2 = torch.randn(12, H, D, generator=torch.Generator().manual_seed(6))
    k_cache = torch.randn(30, SPAN, KVH, D)
    v_cache = torch.randn(30, SPAN, KVH, D)
    q = torch.cat([q1, q2])
    mask = torch.arange(45)[None, :] <= torch.arange(33, 45)[:, None]
    meta = type("Meta", (), {"seqs": [SeqAttention(0, 20, slots1, None, is_causal=True),
                                      SeqAttention(20, 12, slots2, mask)]})()
    calls = []
    real = EXT.prefill_attention
    monkeypatch.setattr(EXT, "prefill_attention", lambda *a: calls.append(a[0].shape) or real(*a), raising=True)
    got = ops.prefill_attention(q, k_cache, v_cache, meta, Attention(D ** -0.5), torch.empty_like(q))
    assert calls == [(20, H, D), (12, H, D)]
    want = prefill_attention_reference(q, k_cache, v_cache, meta, Attention(D ** -0.5), torch.empty_like(q))
    assert (got - want).abs().max().item() < 5e-6
