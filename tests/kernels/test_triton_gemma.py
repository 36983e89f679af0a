"""Gemma 2's features in the Triton kernels (allspark_server/compute/cuda/): the attention logit soft cap and the
sliding window of paged decode and prefill attention (dense and quantized spans, GQA, split-KV merged in the
kernel or by the combine launch, the fused rotary + cache-write decode) and gelu(tanh)·mul, against float64
computations written here. Keys before a window are NaN in the cache and their span-table entries garbage, so a
kernel that reads one shows. On a CUDA machine the tests run on the GPU; elsewhere on CPU tensors under the
Triton interpreter (small shapes: it is slow)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from test_triton_kernels import DEVICE, GARBAGE_SPAN, SCALE, TOL, assert_close, make_cache, quantize_cache

from allspark_server.compute.cuda import attention_kernels as ak
from allspark_server.compute.cuda import decode_attention as da
from allspark_server.compute.cuda import fused_kernels as fk
from allspark_server.quant import kv as kv_quant

# decode contexts against a window of 40: shorter than it, equal, one longer (key 0 drops out), a window starting
# mid-span (150 - 40 = 110 = 6 * 16 + 14) and one starting on a span and a 64-token tile boundary (168 - 40)
LENGTHS = [1, 40, 41, 150, 168]
BIG = 100.0         # std of the scores scale * q.k of the "big" queries: far past the caps of 30 and 50


def queries(rows: int, heads: int, d: int, dtype: torch.dtype, score_std: float, seed: int) -> torch.Tensor:
    """q [rows, H, D] whose scores SCALE * q.k against the caches' N(0, 1) keys have std about score_std."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, d, generator=gen) * (score_std / (SCALE * math.sqrt(d)))).to(DEVICE, dtype)


def attend64(q, k, v, key_pos, q_pos, softcap: float, window: int) -> torch.Tensor:
    """HF Gemma 2's eager attention in float64: q [m, H, D] at positions q_pos [m] over keys k, v [n, KVH, D]
    at key_pos [n]; scores scale * q.k, capped (softcap * tanh(s / softcap)), masked causal and to the window
    (p - j < window) -> [m, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)                  # [n, H, D]
    s = torch.einsum("mhd,nhd->hmn", q, k) * SCALE                                       # [H, m, n]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = key_pos[None, :] <= q_pos[:, None]                                            # [m, n]
    if window:
        seen &= q_pos[:, None] - key_pos[None, :] < window
    return torch.einsum("hmn,nhd->mhd", s.masked_fill(~seen, -math.inf).softmax(-1), v)


def gather64(k64, v64, span_row, lo: int, n: int):
    """Keys lo..n-1 of one sequence from float64 caches [S, P, KVH, D] -> (positions [n - lo], k, v)."""
    span_size, kvh, d = k64.shape[1:]
    t = torch.arange(lo, n)
    slots = span_row[t // span_size].long() * span_size + t % span_size
    return t, k64.view(-1, kvh, d)[slots], v64.view(-1, kvh, d)[slots]


def poison_before(k_cache, v_cache, spans, starts: list[int]) -> None:
    """Sequence b's keys before starts[b] NaN and the span-table entries of its spans wholly before it
    GARBAGE_SPAN: a kernel must read neither."""
    span_size, kvh, d = k_cache.shape[1:]
    for b, lo in enumerate(starts):
        t = torch.arange(lo, device=spans.device)
        slots = spans[b, t // span_size].long() * span_size + t % span_size
        for cache in (k_cache, v_cache):
            cache.view(-1, kvh, d)[slots] = float("nan")
        spans[b, :lo // span_size] = GARBAGE_SPAN


def spans_cache(lengths, starts, kvh, d, span_size, dtype, quant, seed):
    """(k, v, spans, k_param, v_param, k64, v64): caches with keys before starts[b] poisoned; quant "int8" /
    "uint4": quantized spans (NaN params where poisoned or unowned) and their float64 dequantized rows."""
    k, v, spans = make_cache(lengths, kvh, d, span_size, torch.float32 if quant else dtype, seed=seed)
    poison_before(k, v, spans, starts)
    if not quant:
        return k, v, spans, None, None, k.cpu().double(), v.cpu().double()
    (k, k_param), (v, v_param) = quantize_cache(k, quant), quantize_cache(v, quant)
    k64, v64 = (kv_quant.dequantize_rows(c.cpu(), p.cpu(), quant).double() for c, p in ((k, k_param), (v, v_param)))
    return k, v, spans, k_param, v_param, k64, v64


def decode64(q, k64, v64, spans, lengths, softcap: float, window: int) -> torch.Tensor:
    out = []
    for b, n in enumerate(lengths):
        t, k, v = gather64(k64, v64, spans[b].cpu(), max(0, n - window) if window else 0, n)
        out.append(attend64(q[b:b + 1].cpu().double(), k, v, t, torch.tensor([n - 1]), softcap, window)[0])
    return torch.stack(out)                                                                # [B, H, D]


# ---- decode --------------------------------------------------------------------------------------------------

# (dtype of q and dense caches, head dim, span size, GQA group, kv heads, quantized spans)
DECODE_CASES = [
    (torch.float32, 64, 16, 4, 2, None), (torch.bfloat16, 128, 16, 2, 1, None), (torch.bfloat16, 256, 32, 2, 1, None),
    (torch.float32, 128, 16, 2, 1, "int8"), (torch.bfloat16, 64, 16, 8, 1, "uint4"),
]
# (softcap, window, big scores, num_splits): a window alone with moderate scores (where one key more or less
# moves the output), caps on big scores with windows of 40, 7 (inside a span) and none, a window longer than
# every context; one split, three, the default (which a window caps at the tiles it can reach)
DECODE_CALLS = [(0.0, 40, False, None), (30.0, 40, True, 3), (50.0, 7, True, 1), (30.0, 0, True, None),
                (0.0, 1000, False, 3)]


def decode_id(case) -> str:
    dtype, d, span_size, group, kvh, quant = case
    return f"{str(dtype).split('.')[-1]}-D{d}-P{span_size}-G{group}-KVH{kvh}-{quant or 'dense'}"


@pytest.mark.parametrize("dtype,d,span_size,group,kvh,quant", DECODE_CASES, ids=map(decode_id, DECODE_CASES))
def test_decode_softcap_and_window_against_float64(dtype, d, span_size, group, kvh, quant):
    ctx = torch.tensor(LENGTHS, device=DEVICE)
    tol = TOL[dtype]
    caches = {}
    for softcap, window, big, splits in DECODE_CALLS:
        if window not in caches:
            starts = [max(0, n - window) if window else 0 for n in LENGTHS]
            caches[window] = spans_cache(LENGTHS, starts, kvh, d, span_size, dtype, quant, seed=d + group)
        k, v, spans, k_param, v_param, k64, v64 = caches[window]
        q = queries(len(LENGTHS), kvh * group, d, dtype, BIG if big else 1.0, seed=d + int(big))
        out = da.paged_decode_attention(q, k, v, spans, ctx, SCALE, num_splits=splits, k_param=k_param,
                                        v_param=v_param, softcap=softcap, window=window)
        assert out.dtype == dtype
        exact = decode64(q, k64, v64, spans, LENGTHS, softcap, window)
        assert_close(out, exact, tol)
        if softcap:          # the cap matters at these scores
            uncapped = decode64(q, k64, v64, spans, LENGTHS, 0.0, window)
            assert (uncapped - exact).abs().max() > 0.1 * exact.abs().max()


@pytest.mark.parametrize("dtype,d,span_size,group,kvh,quant", DECODE_CASES[1:2] + DECODE_CASES[3:4],
                         ids=map(decode_id, DECODE_CASES[1:2] + DECODE_CASES[3:4]))
def test_decode_softcap_0_window_0_is_the_plain_kernel(dtype, d, span_size, group, kvh, quant):
    # the arguments off compile the kernel without them: the same bits as a call that does not pass them
    k, v, spans, k_param, v_param, k64, v64 = spans_cache(LENGTHS, [0] * len(LENGTHS), kvh, d, span_size, dtype,
                                                          quant, seed=d)
    ctx = torch.tensor(LENGTHS, device=DEVICE)
    q = queries(len(LENGTHS), kvh * group, d, dtype, 1.0, seed=d)
    plain = da.paged_decode_attention(q, k, v, spans, ctx, SCALE, k_param=k_param, v_param=v_param)
    off = da.paged_decode_attention(q, k, v, spans, ctx, SCALE, k_param=k_param, v_param=v_param, softcap=0.0,
                                    window=0)
    assert torch.equal(plain, off)
    assert_close(plain, decode64(q, k64, v64, spans, LENGTHS, 0.0, 0), TOL[dtype])
    if quant is None:    # and the fused rotary launch
        from test_triton_fused import cos_sin, fused_qkv
        _, k_new, v_new = fused_qkv(len(LENGTHS), kvh * group, kvh, d, dtype, seed=d)
        cos, sin = cos_sin(len(LENGTHS), d, dtype, seed=d)
        slots = torch.tensor([int(spans[b, (n - 1) // span_size]) * span_size + (n - 1) % span_size
                              for b, n in enumerate(LENGTHS)], device=DEVICE)
        rotary = (k_new, v_new.view(len(LENGTHS), kvh, d), cos, sin, slots)
        plain = da.paged_decode_attention(q, k.clone(), v.clone(), spans, ctx, SCALE, rotary=rotary)
        off = da.paged_decode_attention(q, k.clone(), v.clone(), spans, ctx, SCALE, rotary=rotary, softcap=0.0,
                                        window=0)
        assert torch.equal(plain, off)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 256)], ids=["float32-D64", "bfloat16-D256"])
def test_decode_with_rotary_softcap_and_window(dtype, d):
    # the fused launch (rotate q and k, write k and v, attend) with a cap and a window equals rotary_store_kv
    # then the attention, and the float64 attention over the caches it leaves
    from test_triton_fused import assert_same_bits, cos_sin, fused_qkv
    kvh, group, span_size, window, lengths = 2, 2, 16, 40, [1, 41, 150]
    k_cache, v_cache, spans, _, _, _, _ = spans_cache(lengths, [max(0, n - window) for n in lengths], kvh, d,
                                                      span_size, dtype, None, seed=d)
    slots = torch.tensor([int(spans[b, (n - 1) // span_size]) * span_size + (n - 1) % span_size
                          for b, n in enumerate(lengths)], device=DEVICE)
    q, k, v = fused_qkv(len(lengths), kvh * group, kvh, d, dtype, seed=d)
    q = q * 8       # scores of std ~ 30 after the rotation (|cos|, |sin| ~ 1): the cap of 30 matters
    cos, sin = cos_sin(len(lengths), d, dtype, seed=d)
    ctx = torch.tensor(lengths, device=DEVICE)
    for splits in (1, None):
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        q_rotated = fk.rotary_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
        ref = da.paged_decode_attention(q_rotated, ref_k, ref_v, spans, ctx, SCALE, num_splits=splits,
                                        softcap=30.0, window=window)
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = da.paged_decode_attention(q, got_k, got_v, spans, ctx, SCALE, num_splits=splits, softcap=30.0,
                                        window=window, rotary=(k, v.view(len(lengths), kvh, d), cos, sin, slots))
        assert_same_bits(got_k, ref_k)
        assert_same_bits(got_v, ref_v)
        assert_close(got, ref, 1e-6 if dtype == torch.float32 else TOL[dtype] / 4)
        exact = decode64(q_rotated, ref_k.cpu().double(), ref_v.cpu().double(), spans, lengths, 30.0, window)
        assert_close(got, exact, TOL[dtype])


def test_decode_window_merged_by_the_combine_launch(monkeypatch):
    # without split counters a second launch merges the partials: it must count the same splits with tiles
    kvh, group, d, span_size, window = 2, 4, 64, 16, 70
    starts = [max(0, n - window) for n in LENGTHS]
    k, v, spans, _, _, k64, v64 = spans_cache(LENGTHS, starts, kvh, d, span_size, torch.float32, None, seed=7)
    ctx = torch.tensor(LENGTHS, device=DEVICE)
    q = queries(len(LENGTHS), kvh * group, d, torch.float32, BIG, seed=7)
    inside = da.paged_decode_attention(q, k, v, spans, ctx, SCALE, num_splits=4, softcap=50.0, window=window)
    monkeypatch.setattr(da, "_split_counters", lambda device, needed: None)
    apart = da.paged_decode_attention(q, k, v, spans, ctx, SCALE, num_splits=4, softcap=50.0, window=window)
    assert_close(inside, decode64(q, k64, v64, spans, LENGTHS, 50.0, window), TOL[torch.float32])
    assert_close(apart, inside, 1e-6)


# ---- prefill -------------------------------------------------------------------------------------------------

# (q_len, ctx_len) chunks: one token, whole prompts, chunks after cached context (3 after 37, 20 after 80, 40
# after 160: with a window of 24 they start mid-span and their query blocks skip tiles), an empty chunk
CHUNKS = [(1, 1), (5, 5), (17, 17), (3, 40), (20, 100), (40, 200), (0, 9)]
PREFILL_CASES = [(torch.float32, 64, 16, 2), (torch.bfloat16, 128, 16, 4), (torch.bfloat16, 256, 32, 2)]
# (softcap, window, big scores): a window alone (longer than the first three contexts), a cap with a window, a
# cap alone, a window of one token (each query sees only itself)
PREFILL_CALLS = [(0.0, 24, False), (30.0, 24, True), (50.0, 0, True), (0.0, 1, False)]


def chunk_rows():
    """(q_start, q_len, ctx_len) of CHUNKS with one unused row after each chunk, the rows' count, and which rows
    are a chunk's."""
    q_len = torch.tensor([m for m, _ in CHUNKS])
    ctx_len = torch.tensor([n for _, n in CHUNKS])
    q_start = torch.cumsum(q_len, 0) - q_len + torch.arange(len(CHUNKS))
    total = int(q_start[-1] + q_len[-1]) + 1
    covered = torch.zeros(total, dtype=torch.bool)
    for start, m in zip(q_start.tolist(), q_len.tolist()):
        covered[start:start + m] = True
    return (q_start, q_len, ctx_len), total, covered


def prefill64(q, k64, v64, spans, q_start, softcap: float, window: int) -> torch.Tensor:
    out = torch.full(q.shape, math.nan, dtype=torch.float64)
    for b, (start, (m, n)) in enumerate(zip(q_start.tolist(), CHUNKS)):
        if m == 0:
            continue
        t, k, v = gather64(k64, v64, spans[b].cpu(), max(0, n - m - window + 1) if window else 0, n)
        out[start:start + m] = attend64(q[start:start + m].cpu().double(), k, v, t, n - m + torch.arange(m),
                                        softcap, window)
    return out


def prefill_id(case) -> str:
    dtype, d, span_size, group = case
    return f"{str(dtype).split('.')[-1]}-D{d}-P{span_size}-G{group}"


@pytest.mark.parametrize("dtype,d,span_size,group", PREFILL_CASES, ids=map(prefill_id, PREFILL_CASES))
def test_prefill_softcap_and_window_against_float64(dtype, d, span_size, group):
    kvh = 1
    (q_start, q_len, ctx_len), total, covered = chunk_rows()
    seqs = [x.to(DEVICE) for x in (q_start, q_len, ctx_len)]
    caches = {}
    for softcap, window, big in PREFILL_CALLS:
        if window not in caches:
            starts = [max(0, n - m - window + 1) if window else 0 for m, n in CHUNKS]
            caches[window] = spans_cache(ctx_len.tolist(), starts, kvh, d, span_size, dtype, None, seed=d)
        k, v, spans, _, _, k64, v64 = caches[window]
        q = queries(total, kvh * group, d, dtype, BIG if big else 1.0, seed=d + int(big))
        out = torch.full_like(q, float("nan"))
        ak.paged_prefill_attention(q, k, v, *seqs, spans, SCALE, out=out, softcap=softcap, window=window)
        assert torch.isnan(out.cpu()[~covered]).all(), "wrote a row of no sequence"
        exact = prefill64(q, k64, v64, spans, q_start, softcap, window)
        assert_close(out.cpu()[covered], exact[covered], TOL[dtype])
        if softcap:
            uncapped = prefill64(q, k64, v64, spans, q_start, 0.0, window)
            assert (uncapped - exact)[covered].abs().max() > 0.1 * exact[covered].abs().max()
        if window == 1:      # each query sees only its own key: its output is that key's v
            for b, (start, (m, n)) in enumerate(zip(q_start.tolist(), CHUNKS)):
                if m:
                    own_v = gather64(k64, v64, spans[b].cpu(), n - m, n)[2].repeat_interleave(group, 1)
                    assert_close(out.cpu()[start:start + m], own_v, TOL[dtype])


def test_prefill_softcap_0_window_0_is_the_plain_kernel():
    dtype, d, span_size, group, kvh = torch.bfloat16, 128, 16, 4, 1
    (q_start, q_len, ctx_len), total, covered = chunk_rows()
    seqs = [x.to(DEVICE) for x in (q_start, q_len, ctx_len)]
    k, v, spans = make_cache(ctx_len.tolist(), kvh, d, span_size, dtype, seed=d)
    q = queries(total, kvh * group, d, dtype, 1.0, seed=d)
    plain = ak.paged_prefill_attention(q, k, v, *seqs, spans, SCALE, max_q_len=40)
    off = ak.paged_prefill_attention(q, k, v, *seqs, spans, SCALE, max_q_len=40, softcap=0.0, window=0)
    assert torch.equal(plain.cpu()[covered], off.cpu()[covered])


def test_softcap_and_window_arguments_are_checked():
    k, v, spans = make_cache([3], 1, 64, 16, torch.float32)
    q = torch.zeros(1, 1, 64, device=DEVICE)
    ctx = torch.tensor([3], device=DEVICE)
    for bad in (dict(softcap=-1.0), dict(window=-1), dict(window=2.5)):
        with pytest.raises(AssertionError):
            da.paged_decode_attention(q, k, v, spans, ctx, SCALE, **bad)


# ---- gelu(tanh)·mul ------------------------------------------------------------------------------------------

def gelu64(x: torch.Tensor) -> torch.Tensor:
    """gelu(x, approximate="tanh") = 0.5 x (1 + tanh(u)) in float64, written as x / (1 + exp(-2u)) (the same
    function; 1 + tanh(u) would cancel to nothing at u << 0), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    return x / (1 + torch.exp(-2 * u))


def gelu_mul64(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's gelu(gate) * up with its roundings: gelu rounded to the dtype, then the product (exact in float64
    for these dtypes' products) rounded -> [T, I] in gate_up's dtype."""
    gate, up = gate_up.cpu().double().chunk(2, dim=-1)
    act = gelu64(gate).to(gate_up.dtype).double()
    return (act * up).to(gate_up.dtype)


def assert_gelu_mul_close(out: torch.Tensor, gate_up: torch.Tensor, ref: torch.Tensor, max_mismatch: float) -> None:
    """NaN and +-inf where ref has them; finite elements within one unit in the last place of the dtype at |ref|
    (fp32: 2^-14 relative: the fp32 rounding of 2u is amplified by |2u| <= 88 in exp(-2u), more so by the
    GPU's approximate exp), plus a floor of the smallest normal times (1 + |gate * up|): exp(-2u) overflows
    fp32 for gelu(x) below |x| 2^-126, which then comes out 0, and subnormals may be flushed; at most a
    `max_mismatch` fraction not equal."""
    gate, up = gate_up.cpu().double().chunk(2, dim=-1)
    out, ref = out.cpu(), ref.cpu()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan()), "NaN where the reference has none, or the reverse"
    inf = ref.isinf()
    assert torch.equal(out[inf], ref[inf]) and torch.isfinite(out[~inf & ~ref.isnan()]).all()
    fin = torch.isfinite(ref)
    o, r = out[fin].double(), ref[fin].double()
    info = torch.finfo(out.dtype)
    rel = 2.0 ** -14 if out.dtype == torch.float32 else info.eps
    bound = rel * r.abs() + info.tiny * (1 + (gate * up)[fin].abs().nan_to_num(posinf=0.0))
    worst = ((o - r).abs() / bound).max().item() if o.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.2f}x the bound"
    assert (o != r).double().mean().item() <= max_mismatch


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 96), (3, 300), (7, 2500)])     # 2500: 3 column blocks, a tail
def test_gelu_tanh_mul_against_float64(dtype, tokens, inter, poisoned_empty):
    from test_triton_fused import rows_view
    gate_up = rows_view(tokens, 2 * inter, dtype, scale=4.0, seed=inter)              # [T, 2I] strided
    out = fk.gelu_tanh_mul(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    # bit for bit but where the fp32 gelu lands on the other side of a rounding boundary than float64's
    assert_gelu_mul_close(out, gate_up, gelu_mul64(gate_up), 1.0 if dtype == torch.float32 else 0.01)
    if dtype != torch.float32:
        # HF's own expression in the dtype agrees where torch's fp32 1 + tanh(u) keeps its digits (|gate| < 3)
        gate, up = gate_up.chunk(2, dim=-1)
        hf = torch.nn.functional.gelu(gate, approximate="tanh") * up
        moderate = (gate.abs() < 3).cpu()
        o, h = out.cpu().double()[moderate], hf.cpu().double()[moderate]
        assert ((o - h).abs() <= h.abs() * torch.finfo(dtype).eps).all() and (o != h).double().mean() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gelu_tanh_mul_extreme_inputs(dtype):
    # zeros, subnormals, the region where torch's gelu cancels (x < -4), underflow to -0, x^3 overflowing
    # (the gelu is x, or -0), the dtype's max (the product overflows to inf), +-inf (inf, or NaN as in torch:
    # -inf * 0) and NaN, each against ups of both signs, 0 and large
    info = torch.finfo(dtype)
    gates = [0.0, -0.0, info.tiny, -info.tiny, 1e-3, -1e-3, 1.0, -1.0, 3.0, -3.0, -4.5, -6.0, -8.0, -10.0, -13.0,
             20.0, -20.0, 100.0, -100.0, 1e4, -1e4, info.max, -info.max, math.inf, -math.inf, math.nan]
    if dtype != torch.bfloat16 or DEVICE == "cuda":     # the interpreter loads bf16 subnormals wrong
        gates += [info.tiny / 4, -info.tiny / 4]
    ups = [1.0, -2.5, 0.0, 1e-3, info.max / 2]
    gate = torch.tensor(gates, dtype=torch.float64).to(dtype)[:, None].expand(-1, len(ups))    # [T, I]
    up = torch.tensor(ups, dtype=torch.float64).to(dtype)[None, :].expand(len(gates), -1)
    gate_up = torch.cat([gate, up], 1).contiguous().to(DEVICE)                                  # [T, 2I]
    out = fk.gelu_tanh_mul(gate_up)
    assert_gelu_mul_close(out, gate_up, gelu_mul64(gate_up), 1.0 if dtype == torch.float32 else 0.05)
    # the float64 formula is HF's: torch's float64 gelu where 1 + tanh keeps its digits
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    assert torch.allclose(gelu64(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-9, atol=1e-12)


def test_cuda_ops_exports_gelu_tanh_mul():
    from allspark_server.compute.cuda import cuda_ops
    assert cuda_ops.gelu_tanh_mul is fk.gelu_tanh_mul
