"""Triton attention over the paged ("span") KV cache: varlen causal prefill, and the tile loop it shares with
decode (decode_attention.py). Caches are [S, P, KVH, D]; token t of a sequence sits in span spans[b, t // P] at
offset t % P. Both take optional ALiBi slopes (compute/alibi.py: score += slope_h * (key position - query
position)), Gemma 2's logit soft cap (score -> cap * tanh(score / cap), before the bias) and a sliding window
(a query at position p sees keys p - window < t <= p); the tile loop also reads quantized spans (int8 / uint4
codes with a scale and zero point per token and KV head, quant/kv.py), dequantized in registers and attended in
fp32 as the reference does. Owns kernels and launch wrappers only, no backend choice (ops decides when to call
these). Launches read no tensor contents on the host (CUDA-graph safe), except paged_prefill_attention when
max_q_len is not given."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Launch shape, from sweeps on an H100 (Triton 3.6, bf16, H 32, KVH 8, D 128, P 16): prefill ran best with 64 rows
# x 32 tokens, 4 warps, 2 stages.
PREFILL_BLOCK_N = 32
LOG2_E = math.log2(math.e)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32; UPCAST (the interpreter with bf16, whose tl.dot multiplies the raw uint16 bits) takes
    the operands, already rounded to the cache dtype, to fp32 first: the same products, exactly."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _row_tile(cache, row, col, ok, offs_d, D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The cache's elements `col` of the tokens' rows `row` (offsets) as stored: [BLOCK_D, BLOCK_N] (TRANSPOSED) or
    [BLOCK_N, BLOCK_D], 0 past D and for tokens not `ok`."""
    if TRANSPOSED:
        ptrs, mask = cache + row[None, :] + col[:, None], ok[None, :] & (offs_d < D)[:, None]
    else:
        ptrs, mask = cache + row[:, None] + col[None, :], ok[:, None] & (offs_d < D)[None, :]
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_rows(cache, param, row, prow, ok, offs_d, D: tl.constexpr, QUANT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Tokens' rows of one KV head: [BLOCK_D, BLOCK_N] (TRANSPOSED, K) or [BLOCK_N, BLOCK_D] (V), row / prow [BLOCK_N]
    the tokens' offsets into the cache and its params. QUANT 1 (int8) / 2 (uint4, element d in the low nibble of
    byte d, element D/2 + d in its high one): dequantized as (code - zero) * scale in fp32 (quant/kv.py)."""
    if QUANT == 2:
        col = offs_d % (D // 2)
        shift = (offs_d >= D // 2).to(tl.int32) * 4
    else:
        col = offs_d
    x = _row_tile(cache, row, col, ok, offs_d, D, TRANSPOSED)
    if QUANT != 0:       # one return for every branch: Triton wants one return type
        codes = x.to(tl.int32)
        if QUANT == 2:
            if TRANSPOSED:
                codes = (codes >> shift[:, None]) & 15
            else:
                codes = (codes >> shift[None, :]) & 15
        scale = tl.load(param + prow, mask=ok, other=0.0)
        zero = tl.load(param + prow + 1, mask=ok, other=0.0)
        if TRANSPOSED:
            x = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]
        else:
            x = (codes.to(tl.float32) - zero[:, None]) * scale[:, None]
    return x


@triton.jit
def _fp8_rows(cache, row, ok, offs_d, D: tl.constexpr, TRANSPOSED: tl.constexpr, dtype: tl.constexpr):
    """fp8 spans' rows as _load_rows lays them out, their codes (the bytes of e4m3 values) in `dtype` unscaled:
    e4m3 values are exact in bf16, fp16 and fp32, so the tensor cores meet them as they are and the rows' scales
    multiply the scores (K) and the probabilities (V) instead."""
    codes = _row_tile(cache, row, offs_d, ok, offs_d, D, TRANSPOSED)
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(dtype)


@triton.jit
def _alibi_log2(slopes, head, ok, HAS_ALIBI: tl.constexpr):
    """The rows' ALiBi slopes times log2(e) (scores are in the log2 domain), 0 without ALiBi."""
    alibi = tl.zeros(head.shape, dtype=tl.float32)
    if HAS_ALIBI:
        alibi = tl.load(slopes + head, mask=ok, other=0.0) * 1.4426950408889634
    return alibi


@triton.jit
def _tanh(x):
    """tanh(x) in fp32 from one exp2: sign(x) (1 - e) / (1 + e), e = exp(-2 |x|) in (0, 1], so it neither
    overflows nor loses more than ~1e-7 absolute to cancellation near 0 (the interpreter has no libdevice)."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)                                       # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tiles(q, pos, alibi, k_cache, v_cache, k_param, v_param, span_row, kv_head, n,
                  tile_start, tile_end, stride_ks, stride_kp, stride_kh, stride_vs, stride_vp, stride_vh,
                  stride_ps, stride_pp, stride_ph, qk_scale, cap, window, key_lo,
                  P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Online softmax of rows q [M, BLOCK_D] over token tiles [tile_start, tile_end) of one sequence; row r
    sees tokens t <= pos[r] (pos < n). Scores are in the log2 domain (qk_scale includes log2(e)); HAS_ALIBI adds
    alibi[r] * (t - pos[r]) to them (alibi [M]: the rows' slopes times log2(e)). HAS_SOFTCAP: the score is
    cap * tanh(q.k * qk_scale) instead, with qk_scale = scale / softcap and cap = softcap * log2(e) (the cap
    applies to the natural-scale score; the bias comes after it). HAS_WINDOW: row r sees only tokens
    t > pos[r] - window, and tokens t < key_lo (before every row's window) are never read, nor their span
    ids; only tiles that start before the last row's window take the window's mask (the others, all of them
    for a window as long as the context, the causal one alone: a branch in the loop, cheaper than masking
    every tile and than a second loop for them); a row may see no token of a tile (its max stays -inf, its
    terms 0). From an empty state -> (acc [M, BLOCK_D] fp32 unnormalized, running max m [M], running sum
    l [M])."""
    acc = tl.zeros([q.shape[0], BLOCK_D], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if HAS_WINDOW:
        in_every_window = tl.max(pos, 0) - window + 1       # tokens from here on are in every row's window
    for tile in range(tile_start, tile_end):
        t = tile * BLOCK_N + offs_n                                                     # [BLOCK_N]
        t_ok = t < n
        if HAS_WINDOW:
            t_ok = t_ok & (t >= key_lo)
        span = tl.load(span_row + t // P, mask=t_ok, other=0).to(tl.int64)            # [BLOCK_N]
        k_row = span * stride_ks + (t % P) * stride_kp + kv_head * stride_kh
        v_row = span * stride_vs + (t % P) * stride_vp + kv_head * stride_vh
        p_row = span * stride_ps + (t % P) * stride_pp + kv_head * stride_ph
        if QUANT == 3:      # fp8 codes in q's dtype, each key's scale on its scores
            kt = _fp8_rows(k_cache, k_row, t_ok, offs_d, D, True, q.dtype)             # [BLOCK_D, BLOCK_N]
            qk = _dot(q, kt, DOT_PREC, UPCAST) * tl.load(k_param + p_row, mask=t_ok, other=0.0)[None, :]
        else:
            kt = _load_rows(k_cache, k_param, k_row, p_row, t_ok, offs_d, D, QUANT, True)   # [BLOCK_D, BLOCK_N]
            qk = _dot(q, kt, DOT_PREC, UPCAST)                                          # [M, BLOCK_N] fp32
        if HAS_SOFTCAP:
            s = cap * _tanh(qk * qk_scale)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            s += alibi[:, None] * (t[None, :] - pos[:, None]).to(tl.float32)
        if HAS_WINDOW:
            if tile * BLOCK_N < in_every_window:
                s = tl.where((t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window), s, float("-inf"))
            else:
                s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))
        else:
            s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                                           # [M]
        if HAS_WINDOW:      # a row with no token seen yet: subtract 0, not -inf (its terms are 0, not NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])                                                 # [M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT == 3:      # each value row's scale on its probabilities
            v = _fp8_rows(v_cache, v_row, t_ok, offs_d, D, False, q.dtype)             # [BLOCK_N, BLOCK_D]
            p_v = p * tl.load(v_param + p_row, mask=t_ok, other=0.0)[None, :]
        else:
            v = _load_rows(v_cache, v_param, v_row, p_row, t_ok, offs_d, D, QUANT, False)   # [BLOCK_N, BLOCK_D]
            p_v = p
        acc = acc * alpha[:, None] + _dot(p_v.to(v.dtype), v, DOT_PREC, UPCAST)         # [M, BLOCK_D] fp32
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, spans, q_start, q_len, ctx_len, slopes, out, qk_scale, cap, window,
                    stride_qt, stride_qh, stride_ks, stride_kp, stride_kh, stride_vs, stride_vp, stride_vh,
                    stride_sb, stride_ot, stride_oh,
                    G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, QUERIES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
    """Program (sequence i, query block, kv head): rows r < QUERIES * G are (query r // G, head r % G), so the
    G heads sharing a kv head read each K/V tile once. HAS_WINDOW: the tiles wholly before the block's first
    query's window are skipped."""
    i = tl.program_id(0)
    first = tl.program_id(1) * QUERIES
    kv_head = tl.program_id(2)
    start = tl.load(q_start + i).to(tl.int64)
    num_q = tl.load(q_len + i).to(tl.int32)
    n = tl.load(ctx_len + i).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qi = first + offs_m // G                                                            # [BLOCK_M] query index
    head = kv_head * G + offs_m % G
    row_ok = (offs_m < QUERIES * G) & (qi < num_q)
    d_ok = offs_d < D
    q_ptrs = q + (start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    qt = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)             # [BLOCK_M, BLOCK_D]
    qt = qt.to(k_cache.dtype.element_ty)
    pos = n - num_q + qi            # causal limit; >= 0, so tile 0 gives every row (padding too) a finite max
    #                                 (a window's rows may see nothing of a tile: _attend_tiles keeps them finite)
    last = tl.minimum(first + QUERIES, num_q)                       # one past the block's last query
    tile_end = tl.where(first < num_q, (n - num_q + last + BLOCK_N - 1) // BLOCK_N, 0)
    tile_start = 0
    key_lo = 0
    if HAS_WINDOW:      # the block's first query sees keys from key_lo on, every later query fewer
        key_lo = n - num_q + first - window + 1
        tile_start = tl.maximum(key_lo, 0) // BLOCK_N
    alibi = _alibi_log2(slopes, head, row_ok, HAS_ALIBI)                                 # [BLOCK_M]
    acc, m_i, l_i = _attend_tiles(qt, pos, alibi, k_cache, v_cache, k_cache, v_cache,
                                  spans + i.to(tl.int64) * stride_sb, kv_head, n, tile_start, tile_end,
                                  stride_ks, stride_kp, stride_kh, stride_vs, stride_vp, stride_vh, 0, 0, 0, qk_scale,
                                  cap, window, key_lo, P, D, BLOCK_N, BLOCK_D, DOT_PREC, UPCAST, HAS_ALIBI, 0,
                                  HAS_SOFTCAP, HAS_WINDOW)
    # l >= 1 on every real row (its max term, its own key's, is exp2(0)); the guard keeps padding rows finite
    o = acc / tl.maximum(l_i, 1.0)[:, None]
    o_ptrs = out + (start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_INTERPRETED = not isinstance(_prefill_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  spans: torch.Tensor) -> tuple[int, int, int]:
    """(G, P, D) of q [.., H, D] against caches [S, P, KVH, D] (uint4 codes: [S, P, KVH, D/2]); head dims and
    span rows must be contiguous."""
    span_size, kvh, d = k_cache.shape[1:]
    if k_cache.dtype == torch.uint8:
        d *= 2
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype, "k/v caches differ"
    assert q.shape[-1] == d and q.shape[-2] % kvh == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "head dim not contiguous"
    assert spans.dim() == 2 and spans.stride(1) == 1, "span table rows must be contiguous"
    return q.shape[-2] // kvh, span_size, d


def _tile_config(d: int, dtype: torch.dtype) -> dict:
    """BLOCK_D the head dim padded to a power of two (masked), fp32 dots without tf32 (int8 / uint4 caches too:
    they are attended in fp32; fp8 caches pass q's dtype), and UPCAST for bf16 under the interpreter. Token tiles
    (BLOCK_N) need not match the span size: each token looks up its span."""
    wide = dtype in (torch.float32, torch.int8, torch.uint8)
    return dict(BLOCK_D=max(16, triton.next_power_of_2(d)), DOT_PREC="ieee" if wide else "tf32",
                UPCAST=_INTERPRETED and dtype == torch.bfloat16)


def _prefill_rows(group: int) -> int:
    """BLOCK_M, the rows (query, head) of one prefill program: at least 64, and room for >= 8 queries."""
    return max(64, triton.next_power_of_2(8 * group))


def _check_slopes(alibi_slopes: torch.Tensor | None, heads: int) -> None:
    assert alibi_slopes is None or (alibi_slopes.shape == (heads,) and alibi_slopes.dtype == torch.float32
                                    and alibi_slopes.is_contiguous()), "alibi_slopes must be fp32 [H], contiguous"


def _gemma_args(scale: float, softcap: float, window: int) -> dict:
    """The tile loop's score arguments: qk_scale and cap (HAS_SOFTCAP: the cap applied to the natural-scale
    score, scale / softcap inside the tanh and softcap * log2(e) outside) and the window. softcap 0 and
    window 0 (off) pass today's qk_scale and compile today's kernel."""
    assert softcap >= 0 and window >= 0 and int(window) == window, "softcap and window must be >= 0"
    if softcap > 0:
        return dict(qk_scale=scale / softcap, cap=softcap * LOG2_E, window=int(window), HAS_SOFTCAP=True,
                    HAS_WINDOW=window > 0)
    return dict(qk_scale=scale * LOG2_E, cap=0.0, window=int(window), HAS_SOFTCAP=False, HAS_WINDOW=window > 0)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                            q_len: torch.Tensor, ctx_len: torch.Tensor, spans: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, max_q_len: int | None = None,
                            alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0,
                            window: int = 0) -> torch.Tensor:
    """Causal attention of a varlen batch: q [T, H, D] holds sequence i's new tokens in rows q_start[i] ..
    q_start[i] + q_len[i] - 1; its ctx_len[i] tokens (cached + new, K/V already stored) are read through
    spans [N, MAXS]; query j sits at position ctx_len[i] - q_len[i] + j. -> out [T, H, D] in q's dtype (rows
    of no sequence are left as they were). max_q_len sizes the grid; None reads q_len on the host. alibi_slopes
    fp32 [H]: query i's score of key t gets slope_h * (t - i). softcap > 0: each score s = scale * q.k becomes
    softcap * tanh(s / softcap) before the bias (Gemma 2). window > 0: the query at position p sees keys
    p - window < t <= p (HF's sliding window); keys before the chunk's first query's window are never read
    (nor their span ids), and tiles wholly before a query block's window are skipped."""
    g, span_size, d = _check_inputs(q, k_cache, v_cache, spans)
    _check_slopes(alibi_slopes, q.shape[-2])
    gemma = _gemma_args(scale, softcap, window)
    kvh = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    num_seqs = q_len.shape[0]
    assert all(x.shape == (num_seqs,) and x.is_contiguous() for x in (q_start, q_len, ctx_len))
    if max_q_len is None:
        max_q_len = int(q_len.max()) if num_seqs else 0
    if num_seqs == 0 or max_q_len == 0:
        return out
    block_m = _prefill_rows(g)
    queries = block_m // g                                          # queries per program; rows = queries * G
    tiles = _tile_config(d, k_cache.dtype)
    _prefill_kernel[(num_seqs, -(-max_q_len // queries), kvh)](
        q, k_cache, v_cache, spans, q_start, q_len, ctx_len, ctx_len if alibi_slopes is None else alibi_slopes, out,
        gemma["qk_scale"], gemma["cap"], gemma["window"],
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], spans.stride(0),
        out.stride(0), out.stride(1),
        G=g, P=span_size, D=d, QUERIES=queries, BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, num_stages=2,
        HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=gemma["HAS_SOFTCAP"], HAS_WINDOW=gemma["HAS_WINDOW"],
        **tiles)
    return out
