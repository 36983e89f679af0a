"""Fused Triton elementwise kernels (allspark_server/cuda/fused_kernels.py) against the torch references in
allspark_server/ops.py: residual add + RMSNorm, rotary (alone and fused with the KV cache write) and silu·mul,
in fp32, bf16 and fp16, over strided views, GQA, odd token counts and head dims, shuffled slots and NaN-poisoned
outputs and caches. On a CUDA machine the tests run on the GPU; elsewhere on CPU tensors under the Triton
interpreter (small shapes: it is slow)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from allspark_server.compute import ops
from allspark_server.compute.cuda import fused_kernels as fk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
EPS = 1e-6


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-for-bit equal (NaN included: a poisoned slot must stay exactly as it was)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.view(BITS[out.dtype]) != ref.view(BITS[ref.dtype])).sum().item()
    assert diff == 0, f"{diff} of {ref.numel()} elements differ"


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float, max_mismatch: float = 1.0) -> None:
    """Finite, |out - ref| <= ulps units in the last place of the dtype (at the larger magnitude), and at
    most a `max_mismatch` fraction of elements not bit-equal."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output"
    o, r = out.double(), ref.double()
    _, exp = torch.frexp(torch.maximum(o.abs(), r.abs()))
    ulp = torch.ldexp(torch.full_like(o, torch.finfo(out.dtype).eps), exp - 1)           # spacing at |x|
    worst = ((o - r).abs() / ulp).max().item()
    assert worst <= ulps, f"{worst:.2f} ulps off"
    mismatch = (out != ref).double().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of elements not bit-equal"


def rows_view(rows: int, cols: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """[rows, cols] whose rows sit inside a wider buffer (row stride cols + 24), like a slice of a fused output."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(rows, cols + 24, generator=gen) * scale
    return buf.to(DEVICE, dtype)[:, 8:8 + cols]


def fused_qkv(tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Strided q [T, h, D], k [T, kvh, D] and v [T, kvh * D] cut from one [T, (h + 2 kvh) * D] tensor."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v


def cos_sin(tokens: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Random [T, 1, D] tables with unequal halves (the kernels must not assume HF's duplicated halves)."""
    gen = torch.Generator().manual_seed(seed + 1)
    cos, sin = torch.randn(2, tokens, 1, d, generator=gen).to(DEVICE, dtype)
    return cos, sin


# ---- RMSNorm ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 96), (7, 1024), (2, 4096)])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_rms_norm(dtype, tokens, hidden, with_residual, poisoned_empty):
    x = rows_view(tokens, hidden, dtype, scale=3.0, seed=hidden)                          # [T, H] strided
    residual = rows_view(tokens, hidden, dtype, seed=hidden + 1) if with_residual else None
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE, dtype)
    out, s = fk.rms_norm(x, weight, EPS, residual)
    ref_out, ref_s = ops.rms_norm_reference(x, weight, EPS, residual)
    # s = x + residual: one rounding of the same fp32 sum, bit-exact; without a residual, x itself (as the
    # reference returns it)
    assert_same_bits(s, ref_s)
    assert (s is x) == (residual is None)
    # normed: the fp32 mean of squares is summed in another order (and rsqrt may differ by an ulp on the GPU),
    # so fp32 agrees to ~1e-6 (8 ulps); bf16/fp16 round that away almost always: <= 3 ulps (a 1-ulp step in
    # the rounded normed is <= 2 ulps of the rounded product, 3 at a binade edge), nearly all bit-equal
    if dtype == torch.float32:
        assert_within_ulps(out, ref_out, 8)
    else:
        assert_within_ulps(out, ref_out, 3, max_mismatch=0.01)


def test_rms_norm_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    out, s = fk.rms_norm(x, torch.ones(64, device=DEVICE), EPS, torch.empty(0, 64, device=DEVICE))
    assert out.shape == s.shape == (0, 64)


# ---- rotary ----------------------------------------------------------------------------------------------

ROTARY_CASES = [  # (tokens, heads, kv heads, head dim): GQA and MHA, D in {64, 128, 80}
    (1, 4, 2, 64), (3, 6, 2, 128), (7, 3, 1, 80), (3, 2, 2, 80),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,heads,kv_heads,d", ROTARY_CASES)
def test_rotary_bit_exact(dtype, tokens, heads, kv_heads, d, poisoned_empty):
    # Same arithmetic as the reference: both products and the sum are each rounded to the dtype (fp32 math in
    # between, no FMA contraction), so every dtype matches bit for bit
    q, k, _ = fused_qkv(tokens, heads, kv_heads, d, dtype, seed=d)
    cos, sin = cos_sin(tokens, d, dtype, seed=d)
    q_out, k_out = fk.rotary(q, k, cos, sin)
    ref_q, ref_k = ops.rotary_reference(q, k, cos, sin)
    assert_same_bits(q_out, ref_q)
    assert_same_bits(k_out, ref_k)
    assert q_out.is_contiguous() and k_out.is_contiguous()


def make_caches(num_spans: int, span_size: int, kv_heads: int, d: int, dtype: torch.dtype):
    """NaN-filled caches [S, P, KVH, D]: a slot written by mistake no longer holds NaN bits."""
    shape = (num_spans, span_size, kv_heads, d)
    return (torch.full(shape, float("nan"), device=DEVICE, dtype=dtype),
            torch.full(shape, float("nan"), device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,heads,kv_heads,d", ROTARY_CASES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_rotary_store_kv_matches_rotary_then_store(dtype, tokens, heads, kv_heads, d, slot_dtype, poisoned_empty):
    # Bit-exact: the rotation is the same arithmetic as rotary_reference; the cache write is a copy
    q, k, v = fused_qkv(tokens, heads, kv_heads, d, dtype, seed=d + 1)
    cos, sin = cos_sin(tokens, d, dtype, seed=d + 1)
    num_spans, span_size = 4, 4
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(num_spans * span_size, generator=gen)[:tokens].to(DEVICE, slot_dtype)  # [T] shuffled
    k_cache, v_cache = make_caches(num_spans, span_size, kv_heads, d, dtype)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q_out = fk.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_q, ref_k = ops.rotary_reference(q, k, cos, sin)
    ops.store_kv_reference(ref_k, v, ref_k_cache, ref_v_cache, slots.long())
    assert_same_bits(q_out, ref_q)
    assert_same_bits(k_cache, ref_k_cache)             # written slots equal, every other slot still NaN
    assert_same_bits(v_cache, ref_v_cache)
    assert torch.isnan(k_cache).sum().item() == (num_spans * span_size - tokens) * kv_heads * d


def test_rotary_store_kv_takes_v_as_heads():
    # v given as [T, kvh, D] (rather than the flat [T, kvh * D] slice) lands the same
    q, k, v = fused_qkv(3, 4, 2, 64, torch.bfloat16, seed=5)
    cos, sin = cos_sin(3, 64, torch.bfloat16)
    slots = torch.tensor([9, 2, 5], device=DEVICE)
    flat = make_caches(3, 4, 2, 64, torch.bfloat16)
    heads = make_caches(3, 4, 2, 64, torch.bfloat16)
    fk.rotary_store_kv(q, k, v, cos, sin, *flat, slots)
    fk.rotary_store_kv(q, k, v.reshape(3, 2, 64), cos, sin, *heads, slots)
    assert_same_bits(flat[0], heads[0])
    assert_same_bits(flat[1], heads[1])


# ---- silu·mul --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 96), (3, 300), (7, 2500)])     # 2500: 3 column blocks, a tail
def test_silu_mul(dtype, tokens, inter, poisoned_empty):
    gate_up = rows_view(tokens, 2 * inter, dtype, scale=4.0, seed=inter)                # [T, 2I] strided
    out = fk.silu_mul(gate_up)
    ref = ops.silu_mul_reference(gate_up)
    # Rounded where the reference rounds (silu, then the product), but the fp32 silu is not torch's: its exp
    # differs (on the GPU Triton's fp32 exp is exp2(x * log2 e): ~|x| * 2^-24 relative error, and the inputs
    # reach |x| ~ 16) and torch's CPU silu is not quite x / (1 + exp(-x)) either, so fp32 agrees to ~2e-6
    # (16 ulps); bf16/fp16 round that away almost always: <= 3 ulps as in test_rms_norm, nearly all bit-equal
    if dtype == torch.float32:
        assert_within_ulps(out, ref, 16)
    else:
        assert_within_ulps(out, ref, 3, max_mismatch=0.01)


# ---- CUDA graphs -----------------------------------------------------------------------------------------

@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_kernels_replay_in_a_cuda_graph_with_new_contents():
    dtype, tokens, heads, kv_heads, d, hidden, inter = torch.bfloat16, 2, 8, 2, 128, 512, 384
    x, residual = rows_view(tokens, hidden, dtype, seed=1), rows_view(tokens, hidden, dtype, seed=2)
    weight = torch.rand(hidden, device=DEVICE, dtype=dtype) + 0.5
    q, k, v = fused_qkv(tokens, heads, kv_heads, d, dtype)
    cos, sin = cos_sin(tokens, d, dtype)
    slots = torch.tensor([5, 1], device=DEVICE)
    k_cache, v_cache = make_caches(2, 4, kv_heads, d, dtype)
    gate_up = rows_view(tokens, 2 * inter, dtype, seed=3)

    def step():
        return (fk.rms_norm(x, weight, EPS, residual), fk.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots),
                fk.silu_mul(gate_up))
    step()                                                                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, s), q_out, act = step()
    for t in (x, residual, q, k, v, cos, sin, gate_up):
        t.copy_(torch.randn_like(t))
    slots.copy_(torch.tensor([2, 7], device=DEVICE))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    graph.replay()
    ref_out, ref_s = ops.rms_norm_reference(x, weight, EPS, residual)
    assert_same_bits(s, ref_s)
    assert_within_ulps(out, ref_out, 3)
    ref_q, ref_k = ops.rotary_reference(q, k, cos, sin)
    ops.store_kv_reference(ref_k, v, ref_k_cache, ref_v_cache, slots)
    assert_same_bits(q_out, ref_q)
    assert_same_bits(k_cache, ref_k_cache)
    assert_same_bits(v_cache, ref_v_cache)
    assert_within_ulps(act, ops.silu_mul_reference(gate_up), 3)
