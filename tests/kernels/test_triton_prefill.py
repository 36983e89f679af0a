"""Triton varlen causal prefill attention over paged KV (allspark_server/compute/cuda/attention_kernels.py) against
float64 and torch references: whole prompts, chunks after cached context, empty chunks, GQA, odd head dims, `out=`,
the step's GPU wiring (cuda/ops.prefill_attention) and ALiBi slopes, over the caches of paged_attention_cases.py.
Decode: test_triton_kernels.py. On a CUDA machine the tests run on the GPU; elsewhere on CPU tensors under the
Triton interpreter (small shapes: it is slow)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F
from paged_attention_cases import DEVICE, SCALE, TOL, assert_close, case_id, make_cache

from allspark_server.compute import (
    ops,
    reference,
)
from allspark_server.compute.cuda import attention_kernels as ak
from allspark_server.compute.steps import Attention

# ---- prefill -------------------------------------------------------------------------------------------------

def prefill_ref(q, k_cache, v_cache, q_start, q_len, ctx_len, spans, dtype):
    """Gather + SDPA with the causal-with-offset mask, per sequence, in `dtype` on the CPU -> [T, H, D]."""
    q, k_cache, v_cache, spans = (x.cpu().to(dtype) if x.is_floating_point() else x.cpu()
                                  for x in (q, k_cache, v_cache, spans))
    span_size, kvh = k_cache.shape[1:3]
    out = torch.full_like(q, float("nan"))
    for start, m, n, row in zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist(), spans):
        slots = (row[:-(-n // span_size)][:, None] * span_size + torch.arange(span_size)).reshape(-1)[:n]
        k, v = reference.gather_kv(k_cache, v_cache, slots)                                  # [n, KVH, D]
        pos = n - m + torch.arange(m)                                                   # [m] query positions
        mask = torch.arange(n)[None, :] <= pos[:, None]                                 # [m, n]
        o = F.scaled_dot_product_attention(q[start:start + m].transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask, scale=SCALE,
                                           enable_gqa=kvh != q.shape[1])               # [H, m, D]
        out[start:start + m] = o.transpose(0, 1)
    return out


# (q_len, ctx_len) chunks: one token, a whole prompt, a prompt just over a span, a chunk over cached context,
# a long chunk over a long context, an empty chunk
CHUNKS = [(1, 1), (5, 5), (17, 17), (3, 40), (70, 300), (0, 9)]
PREFILL_CASES = [
    (torch.float32, 64, 16, 1), (torch.float32, 80, 32, 8),
    (torch.bfloat16, 128, 32, 4), (torch.bfloat16, 96, 16, 8), (torch.float32, 64, 24, 2),
]


@pytest.mark.parametrize("dtype,d,span_size,group", PREFILL_CASES, ids=map(case_id, PREFILL_CASES))
def test_prefill_against_float64_and_torch(dtype, d, span_size, group):
    kvh = 2 if group < 8 else 1
    q_len = torch.tensor([m for m, _ in CHUNKS])
    ctx_len = torch.tensor([n for _, n in CHUNKS])
    q_start = torch.cumsum(q_len, 0) - q_len + torch.arange(len(CHUNKS))   # one unused row after each chunk
    total = int(q_start[-1] + q_len[-1]) + 1
    k_cache, v_cache, spans = make_cache(ctx_len.tolist(), kvh, d, span_size, dtype, seed=d + group)
    q = torch.randn(total, kvh * group, d).to(DEVICE, dtype)                         # [T, H, D]
    seqs = [x.to(DEVICE) for x in (q_start, q_len, ctx_len)]
    out = torch.full_like(q, float("nan"))
    got = ak.paged_prefill_attention(q, k_cache, v_cache, *seqs, spans, SCALE, out=out)
    assert got.data_ptr() == out.data_ptr()
    covered = torch.zeros(total, dtype=torch.bool)
    for start, m in zip(q_start.tolist(), q_len.tolist()):
        covered[start:start + m] = True
    assert torch.isnan(out.cpu()[~covered]).all(), "wrote a row of no sequence"
    exact = prefill_ref(q, k_cache, v_cache, q_start, q_len, ctx_len, spans, torch.float64)
    ref = prefill_ref(q, k_cache, v_cache, q_start, q_len, ctx_len, spans, dtype)
    assert_close(out.cpu()[covered], exact[covered], TOL[dtype])
    assert_close(out.cpu()[covered], ref[covered], TOL[dtype])
    again = ak.paged_prefill_attention(q, k_cache, v_cache, *seqs, spans, SCALE, max_q_len=int(q_len.max()))
    assert torch.equal(again.cpu()[covered], out.cpu()[covered])


def test_a_mixed_steps_chunks_through_the_gpu_wiring_equal_the_per_chunk_reference():
    """The step's wiring (cuda/ops.prefill_attention on build_forward_inputs' prefill_* tensors): a decode row,
    a whole prompt and a chunk after cached tokens, with span tables shuffled, against ops' per-chunk reference
    (gather + SDPA with the chunk's mask) in float64."""
    from allspark_server.compute.cuda import cuda_ops
    from allspark_server.core.messages import ScheduledChunk
    from allspark_server.step.inputs import RequestMirror, build_forward_inputs
    span_size, kvh, group, d = 16, 2, 4, 64
    mirrors = {1: RequestMirror(list(range(40)), [7, 2, 5], 39),      # decodes its 40th token
               2: RequestMirror(list(range(21)), [0, 4], 0),          # a 21-token prompt, all of it
               3: RequestMirror(list(range(50)), [6, 1, 3, 8], 30)}   # tokens 30..49 after 30 cached
    chunks = [ScheduledChunk(1, 1, True), ScheduledChunk(2, 21, True), ScheduledChunk(3, 20, True)]
    inputs = build_forward_inputs(chunks, mirrors, span_size)
    meta = inputs.attn
    assert meta.prefill_q_start.tolist() == [1, 22] and meta.prefill_q_len.tolist() == [21, 20]
    assert meta.prefill_ctx.tolist() == [21, 50] and meta.prefill_max_q == 21
    assert meta.prefill_spans.tolist() == [[0, 4, 0, 0], [6, 1, 3, 8]]
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(9, span_size, kvh, d, generator=gen)
    v_cache = torch.randn(9, span_size, kvh, d, generator=gen)
    q = torch.randn(inputs.input_ids.shape[0], kvh * group, d, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        gpu_meta = inputs.to(torch.device(DEVICE)).attn if DEVICE == "cuda" else meta
        out = torch.full_like(q, float("nan")).to(DEVICE, dtype)
        cuda_ops.prefill_attention(q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype),
                                   gpu_meta, Attention(SCALE), out)
        exact = torch.full_like(q, float("nan")).double()
        ops.prefill_attention_reference(q.to(dtype).double(), k_cache.to(dtype).double(),
                                        v_cache.to(dtype).double(), meta, Attention(SCALE), exact)
        assert torch.isnan(out[0].cpu()).all(), "wrote the decode row"
        assert_close(out.cpu()[1:], exact[1:], TOL[dtype])


# ---- ALiBi ---------------------------------------------------------------------------------------------------

def test_prefill_with_alibi_slopes():
    from allspark_server.compute import alibi
    dtype, d, span_size, group, kvh = torch.float32, 64, 16, 4, 2
    chunks = [(1, 1), (5, 5), (3, 40), (20, 70)]
    q_len = torch.tensor([m for m, _ in chunks])
    ctx_len = torch.tensor([n for _, n in chunks])
    q_start = torch.cumsum(q_len, 0) - q_len
    k_cache, v_cache, spans = make_cache(ctx_len.tolist(), kvh, d, span_size, dtype, seed=10)
    q = torch.randn(int(q_len.sum()), kvh * group, d).to(DEVICE, dtype)               # [T, H, D]
    slopes = alibi.alibi_slopes(kvh * group)
    out = ak.paged_prefill_attention(q, k_cache, v_cache, *(x.to(DEVICE) for x in (q_start, q_len, ctx_len)), spans,
                                     SCALE, alibi_slopes=slopes.to(DEVICE))
    kc, vc, sp = k_cache.cpu().double(), v_cache.cpu().double(), spans.cpu()
    for start, m, n, row in zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist(), sp):
        slots = (row[:-(-n // span_size)][:, None] * span_size + torch.arange(span_size)).reshape(-1)[:n]
        k, v = reference.gather_kv(kc, vc, slots)                                            # [n, KVH, D]
        want = F.scaled_dot_product_attention(
            q.cpu().double()[start:start + m].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=alibi.prefill_bias(slopes.double(), m, n), scale=SCALE, enable_gqa=True)   # [H, m, D]
        assert_close(out[start:start + m], want.transpose(0, 1), TOL[dtype])
