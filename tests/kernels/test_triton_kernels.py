"""Triton paged decode attention (allspark_server/compute/cuda/decode_attention.py) against float64 and torch
references: GQA, split-KV merged in the kernel or by a second launch, rotary and the cache write in the same
launch, odd head dims, `out=`, CUDA graphs, ALiBi slopes and quantized spans, over the caches of
paged_attention_cases.py. Prefill: test_triton_prefill.py. On a CUDA machine the tests run on the GPU; elsewhere
on CPU tensors under the Triton interpreter (small shapes: it is slow)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# GARBAGE_SPAN is not used here: test_triton_gemma.py imports it from this module
from paged_attention_cases import (  # noqa: F401
    DEVICE,
    GARBAGE_SPAN,
    SCALE,
    TOL,
    assert_close,
    case_id,
    decode_refs,
    lengths_for,
    make_cache,
    quantize_cache,
)

from allspark_server.compute import ops
from allspark_server.compute.cuda import decode_attention as da
from allspark_server.compute.steps import Attention

# (dtype, head dim, span size, GQA group): together every dtype, D in {64, 128, 80, 96}, P in {16, 32} and
# G in {1, 4, 8} (G = 1: H == KVH), without the whole product the interpreter could not afford; P = 24 puts
# span boundaries inside the kernel's token tiles
DECODE_CASES = [
    (torch.float32, 64, 16, 1), (torch.float32, 128, 32, 4), (torch.float32, 80, 16, 8),
    (torch.bfloat16, 64, 32, 8), (torch.bfloat16, 128, 16, 1), (torch.bfloat16, 96, 32, 4),
    (torch.float16, 80, 32, 1), (torch.float32, 64, 24, 2),
]


@pytest.mark.parametrize("dtype,d,span_size,group", DECODE_CASES, ids=map(case_id, DECODE_CASES))
def test_decode_against_float64_and_torch(dtype, d, span_size, group):
    kvh = 2
    lengths = lengths_for(span_size)
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, dtype, seed=d + group)
    q = torch.randn(len(lengths), kvh * group, d).to(DEVICE, dtype)               # [B, H, D]
    ctx = torch.tensor(lengths, device=DEVICE)
    out = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE)
    assert out.shape == q.shape and out.dtype == dtype
    exact, ref = decode_refs(q, k_cache, v_cache, spans, ctx)
    assert_close(out, exact, TOL[dtype])
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_split_counts_agree(dtype):
    # 5 splits of a 1-token context leave 4 splits empty; 2 splits of 300 tokens are uneven (5 tiles of 64)
    lengths, kvh, group, d, span_size = [1, 17, 300], 1, 4, 64, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, dtype, seed=1)
    q = torch.randn(len(lengths), kvh * group, d).to(DEVICE, dtype)
    ctx = torch.tensor(lengths, device=DEVICE)
    exact, _ = decode_refs(q, k_cache, v_cache, spans, ctx)
    outs = [da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=s) for s in (1, 2, 5, None)]
    for out in outs:
        assert_close(out, exact, TOL[dtype])
    if dtype == torch.float32:
        for out in outs[1:]:
            assert_close(out, outs[0], 1e-6)


def test_decode_writes_into_out_views_and_every_element():
    # q is a strided view of a fused qkv tensor, out a strided view of a NaN-filled buffer; int64 span table
    lengths, kvh, group, d, span_size = [5, 33], 2, 4, 64, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, torch.float32, seed=2, index_dtype=torch.int64)
    heads = kvh * group
    qkv = torch.randn(len(lengths), heads + 2 * kvh, d, device=DEVICE)          # [B, H + 2 KVH, D]
    q = qkv[:, :heads]                                                              # [B, H, D], stride(0) != H * D
    ctx = torch.tensor(lengths, device=DEVICE, dtype=torch.int32)
    exact, _ = decode_refs(q, k_cache, v_cache, spans, ctx)
    for splits in (1, 3):
        buf = torch.full((len(lengths), heads + 1, d), float("nan"), device=DEVICE)  # [B, H + 1, D]
        out = buf[:, 1:]
        got = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=splits, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_close(out, exact, TOL[torch.float32])
        assert torch.isnan(buf[:, 0]).all(), "wrote outside out"
        same = da.paged_decode_attention(q, k_cache, v_cache, spans.int(), ctx, SCALE, num_splits=splits)
        assert torch.equal(same, out), "int32 and int64 span tables differ"


def test_decode_merges_its_splits_itself_as_the_combine_launch_does(monkeypatch):
    # the last split of a (sequence, kv head) to finish merges the partials (its counter back at 0 after);
    # without counters a second launch merges them: the same result. 1 token: one split with tiles, no merge
    lengths, kvh, group, d, span_size = [1, 17, 300, 64, 129], 2, 4, 64, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, torch.float32, seed=4)
    q = torch.randn(len(lengths), kvh * group, d).to(DEVICE)
    ctx = torch.tensor(lengths, device=DEVICE)
    exact, _ = decode_refs(q, k_cache, v_cache, spans, ctx)
    merged_inside = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=5)
    from allspark_server.compute.cuda import stream_counters
    assert not any(b.any() for bufs in stream_counters._BUFFERS.values() for b in bufs), "a counter was left non-zero"
    monkeypatch.setattr(da, "_split_counters", lambda device, needed: None)
    merged_apart = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=5)
    assert_close(merged_inside, exact, TOL[torch.float32])
    assert_close(merged_inside, merged_apart, 1e-6)


def test_decode_launch_shape_override_gives_the_same_attention():
    # benchmarks/decode_attention_sweep.py's `launch`: other token tiles and warps, the same softmax
    lengths, kvh, group, d, span_size = [3, 100], 2, 2, 64, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, torch.float32, seed=5)
    q = torch.randn(len(lengths), kvh * group, d).to(DEVICE)
    ctx = torch.tensor(lengths, device=DEVICE)
    exact, _ = decode_refs(q, k_cache, v_cache, spans, ctx)
    out = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=2,
                                    launch=dict(BLOCK_N=16, num_warps=2, num_stages=2))
    assert_close(out, exact, TOL[torch.float32])


@pytest.mark.skipif(DEVICE != "cuda", reason="streams need a GPU")
def test_split_counters_are_per_stream_and_a_capture_takes_the_default_streams():
    # a graph warm-up on a side stream must not share counters with steps running on the default stream; a
    # graph captured (on its own stream) is replayed on the default stream, so it takes that stream's
    device = torch.device(DEVICE, torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = da._split_counters(device, 8)
    on_default = da._split_counters(device, 8)
    assert on_side.data_ptr() != on_default.data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        in_capture = da._split_counters(device, 8)
    assert in_capture.data_ptr() == on_default.data_ptr()


ROTARY_DECODE_CASES = [(torch.float32, 64, 16, 4), (torch.bfloat16, 128, 16, 1), (torch.float16, 80, 32, 2)]


def rotary_case(dtype, d, span_size, group):
    """(kv heads, lengths, (k cache, v cache, spans), each sequence's new slot, (q, k, v) unrotated from one fused
    tensor, (cos, sin), ctx) for the fused decode's rotary cases."""
    from test_triton_fused import cos_sin, fused_qkv
    kvh, lengths = 2, [1, span_size + 1, 300]
    caches = make_cache(lengths, kvh, d, span_size, dtype, seed=d)
    spans = caches[2]
    slots = torch.tensor([int(spans[b, (n - 1) // span_size]) * span_size + (n - 1) % span_size
                          for b, n in enumerate(lengths)], device=DEVICE)
    return (kvh, lengths, caches, slots, fused_qkv(len(lengths), kvh * group, kvh, d, dtype, seed=d),
            cos_sin(len(lengths), d, dtype, seed=d), torch.tensor(lengths, device=DEVICE))


@pytest.mark.parametrize("dtype,d,span_size,group", ROTARY_DECODE_CASES, ids=map(case_id, ROTARY_DECODE_CASES))
def test_decode_with_rotary_equals_rotary_store_kv_then_decode(dtype, d, span_size, group):
    # q and the new token's k unrotated, k and v written into their slots by the attention launch itself: the
    # caches end bit for bit as fused_kernels.rotary_store_kv leaves them (NaN slots untouched), and the
    # output is the attention over them of q rotated (one split, a few, the default)
    from test_triton_fused import assert_same_bits

    from allspark_server.compute.cuda import fused_kernels as fk
    kvh, lengths, (k_cache, v_cache, spans), slots, (q, k, v), (cos, sin), ctx = rotary_case(dtype, d, span_size, group)
    for splits in (1, 3, None):
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        q_rotated = fk.rotary_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
        ref = da.paged_decode_attention(q_rotated, ref_k, ref_v, spans, ctx, SCALE, num_splits=splits)
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = da.paged_decode_attention(q, got_k, got_v, spans, ctx, SCALE, num_splits=splits,
                                        rotary=(k, v.view(len(lengths), kvh, d), cos, sin, slots))
        assert_same_bits(got_k, ref_k)
        assert_same_bits(got_v, ref_v)
        assert_close(got, ref, 1e-6 if dtype == torch.float32 else TOL[dtype] / 4)
        assert_close(got, decode_refs(q_rotated, ref_k, ref_v, spans, ctx)[0], TOL[dtype])


@pytest.mark.parametrize("dtype,d,span_size,group", ROTARY_DECODE_CASES, ids=map(case_id, ROTARY_DECODE_CASES))
def test_decode_adds_q_k_v_deltas_as_it_loads_them(dtype, d, span_size, group):
    # grouped LoRA rows' q|k|v deltas (fp32, compute/pending_delta.py) added by the launch: the caches and the
    # output bit for bit those of the launch over q, k and v with the deltas added first (rounded to nearest)
    from test_triton_fused import assert_same_bits
    kvh, lengths, (k_cache, v_cache, spans), slots, (q, k, v), (cos, sin), ctx = rotary_case(dtype, d, span_size, group)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v], -1)
    delta = torch.randn(qkv.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE) * 0.3
    added = (qkv.float() + delta).to(dtype)

    def attend(qkv, delta=None):
        q_, k_, v_ = qkv.split([kvh * group * d, kvh * d, kvh * d], -1)
        caches = k_cache.clone(), v_cache.clone()
        out = da.paged_decode_attention(q_.view(len(lengths), -1, d), *caches, spans, ctx, SCALE, num_splits=3,
                                        rotary=(k_.view(len(lengths), kvh, d), v_.view(len(lengths), kvh, d), cos,
                                                sin, slots), delta=delta)
        return out, *caches

    want = attend(added)
    for got, expected in zip(attend(qkv, delta), want):
        assert_same_bits(got, expected)
    assert not torch.equal(attend(qkv)[0], want[0]), "the deltas changed nothing"


def test_default_num_splits_depends_on_shapes_only():
    assert da.default_num_splits(1, 1, 1000, 16) == da.MAX_SPLITS                # small batch: capped
    assert da.default_num_splits(4, 8, 1000, 16) == -(-da.TARGET_PROGRAMS // 32)
    tiles = 3 * 64 // da.DECODE_BLOCK_N
    assert da.default_num_splits(2, 2, 3, 64) == tiles                           # one split per addressable tile
    assert da.default_num_splits(1024, 8, 1000, 16) == 1                         # big batch: no split


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_with_new_contents():
    lengths, kvh, group, d, span_size = [40, 7], 2, 4, 128, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, torch.bfloat16, seed=3)
    q = torch.randn(len(lengths), kvh * group, d, device=DEVICE, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, device=DEVICE)
    out = torch.empty_like(q)
    da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, out=out)     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, out=out)
    ctx.copy_(torch.tensor([7, 40], device=DEVICE))
    spans.copy_(spans.flip(0))
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_close(out, decode_refs(q, k_cache, v_cache, spans, ctx)[0], TOL[torch.bfloat16])


# ---- ALiBi ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_with_alibi_slopes(dtype):
    """Slopes per head (compute/alibi.py) against the float64 torch reference with the same slopes (test_alibi.py
    checks that reference by hand), for one split and several (the bias is a function of the key's position
    only, so each split adds it on its own)."""
    from allspark_server.compute import alibi
    lengths, kvh, group, d, span_size = [1, 17, 300], 2, 4, 64, 16
    k_cache, v_cache, spans = make_cache(lengths, kvh, d, span_size, dtype, seed=9)
    q = torch.randn(len(lengths), kvh * group, d).to(DEVICE, dtype)
    ctx = torch.tensor(lengths, device=DEVICE)
    slopes = alibi.alibi_slopes(kvh * group)
    exact = ops.decode_attention_reference(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                           spans.cpu(), ctx.cpu(), Attention(SCALE), alibi_slopes=slopes)
    plain, _ = decode_refs(q, k_cache, v_cache, spans, ctx)
    assert (exact - plain).abs().max().item() > 0.05          # the bias matters at these lengths
    for splits in (1, 3, None):
        out = da.paged_decode_attention(q, k_cache, v_cache, spans, ctx, SCALE, num_splits=splits,
                                        alibi_slopes=slopes.to(DEVICE))
        assert_close(out, exact, TOL[dtype])


# ---- quantized spans -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,d,group", [("int8", 64, 4), ("int8", 80, 1), ("uint4", 64, 2), ("uint4", 128, 1),
                                          ("fp8", 64, 4), ("fp8", 128, 1)])
def test_decode_over_quantized_spans(mode, d, group):
    """Codes and params against the float64 attention over the dequantized rows and against ops' reference
    (which dequantizes and attends in fp32), split-KV and not; q in bf16 and fp32."""
    from allspark_server.quant import kv as kv_quant
    kvh, span_size = 2, 16
    lengths = lengths_for(span_size)
    k_dense, v_dense, spans = make_cache(lengths, kvh, d, span_size, torch.float32, seed=d + group)
    (k_codes, k_param), (v_codes, v_param) = quantize_cache(k_dense, mode), quantize_cache(v_dense, mode)
    k_deq = kv_quant.dequantize_rows(k_codes.cpu(), k_param.cpu(), mode).double()
    v_deq = kv_quant.dequantize_rows(v_codes.cpu(), v_param.cpu(), mode).double()
    ctx = torch.tensor(lengths, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(len(lengths), kvh * group, d).to(DEVICE, dtype)                   # [B, H, D]
        exact = ops.decode_attention_reference(q.cpu().double(), k_deq, v_deq, spans.cpu(), ctx.cpu(),
                                               Attention(SCALE))
        ref = ops.decode_attention_reference(q.cpu(), k_codes.cpu(), v_codes.cpu(), spans.cpu(), ctx.cpu(),
                                             Attention(SCALE), k_param.cpu(), v_param.cpu())
        for splits in (1, None):
            out = da.paged_decode_attention(q, k_codes, v_codes, spans, ctx, SCALE, num_splits=splits,
                                            k_param=k_param, v_param=v_param)
            assert out.dtype == dtype
            assert_close(out, exact, TOL[dtype])
            assert_close(out, ref, 1e-5 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("merge", ["in-kernel", "launch"])
def test_decode_in_invariant_rows_takes_two_tiles_a_split(dtype, merge, monkeypatch):
    """In invariant-rows mode (every step of a speculating 7B-sized model) a 16-bit cache's split takes at least
    two token tiles: a 4-tile context asked for 4 splits is the default launch's 2 splits bit for bit; a verify
    chunk's rows (one sequence, alone rows) are each what it is alone in the mode; all near float64. Either merge
    of the splits (the kernel's own, the combine launch) counts the splits the same way."""
    from test_triton_fused import assert_same_bits

    from allspark_server.compute.row_mode import alone_rows, invariant_rows
    if merge == "launch":
        monkeypatch.setattr(da, "_split_counters", lambda device, needed: None)
    kvh, group, d, span_size, n = 2, 4, 64, 16, 4 * da.DECODE_BLOCK_N
    k_cache, v_cache, spans = make_cache([n], kvh, d, span_size, dtype, seed=12)
    q = torch.randn(3, kvh * group, d, generator=torch.Generator().manual_seed(13)).to(DEVICE, dtype)
    ctx = torch.tensor([n - 2, n - 1, n], device=DEVICE)
    rows = spans.repeat(3, 1)

    def attend(i: int, **kw):
        return da.paged_decode_attention(q[i:i + 1], k_cache, v_cache, spans, ctx[i:i + 1], SCALE, **kw)

    with invariant_rows():
        alone = torch.cat([attend(i, num_splits=4) for i in range(3)])
        with alone_rows():
            chunk = da.paged_decode_attention(q, k_cache, v_cache, rows, ctx, SCALE, num_splits=4)
    halved = torch.cat([attend(i, num_splits=2, launch=da.INVARIANT_LAUNCH) for i in range(3)])
    assert_same_bits(alone, halved)
    assert_same_bits(chunk, alone)
    assert_close(chunk, decode_refs(q, k_cache, v_cache, rows, ctx)[0], TOL[dtype])
