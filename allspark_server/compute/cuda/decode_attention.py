"""Triton decode attention over the span cache (attention_kernels.py's tile loop): one query per sequence, the
query heads of one KV head together, split-KV for long contexts. One launch rotates q and the new token's k,
writes k and v into the cache, attends (rotary_store_kv and the attention in one, for dense caches), and merges
the splits in the last split to finish: a counter per sequence and kv head, left at zero, instead of a second
launch. Owns the kernel and its launch wrapper only; launches read no tensor contents on the host (CUDA-graph
safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from allspark_client import settings
from allspark_server.compute import row_mode
from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.attention_kernels import (
    _INTERPRETED,
    _alibi_log2,
    _attend_tiles,
    _check_inputs,
    _check_slopes,
    _gemma_args,
    _tile_config,
)
from allspark_server.compute.cuda.fused_kernels import _rotated, _round
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous
from allspark_server.compute.cuda.stream_counters import stream_counters
from allspark_server.quant import kv as kv_quant

# Launch shapes, from sweeps on an H100 (Triton 3.6, bf16, H 32, KVH 8, D 128, P 16): decode tiles of 64 tokens
# beat 16 and 32; split-KV ran best at 512-1024 (sequence, kv head, split) programs for B = 1 and 8.
DECODE_BLOCK_N = 64
TARGET_PROGRAMS = 768   # default split-KV: about this many decode programs ...
MAX_SPLITS = 64         # ... and never more partials than this per (sequence, head)
# 16-bit caches with batch x kv heads >= 512: 2 warps and 2 stages per program instead of Triton's 4 and 3
# (benchmarks/decode_attention_sweep.py on an H100: 5-16% faster at
# B 16-128, KVH 8 and 32, contexts 192-256; smaller batches were not swept and keep Triton's defaults)
LARGE_BATCH_PROGRAMS = 512
LARGE_BATCH_LAUNCH = dict(num_warps=2, num_stages=2)
# invariant-rows mode (every step of a speculating 7B-sized model, compute/row_mode.py), 16-bit caches: 2 warps and at
# least 2 tiles a split, from an H200 sweep of a one-row step and a 5-row verify chunk at context 1024 (bf16, H 32,
# KVH 8, D 128); from 2 x NUM_SPLITS tiles on, the splits are the default's
INVARIANT_LAUNCH = dict(num_warps=2, num_stages=3)
INVARIANT_MIN_TILES = 2


@triton.jit
def _split_tiles(n, split, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 MIN_TILES: tl.constexpr):
    """Token tiles [start, end) of split `split` of a context of n >= 1 tokens, and how many splits have tiles
    (the first `active` ones: split 0 always), at least MIN_TILES a split. HAS_WINDOW: only the tiles from the one
    holding key n - window on are shared out (the query at n - 1 sees keys t >= n - window)."""
    num_tiles = (n + BLOCK_N - 1) // BLOCK_N
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(n - window, 0) // BLOCK_N
    per_split = tl.maximum((num_tiles - first + NUM_SPLITS - 1) // NUM_SPLITS, MIN_TILES)
    start = first + split * per_split
    return start, tl.minimum(start + per_split, num_tiles), (num_tiles - first + per_split - 1) // per_split


@triton.jit
def _fence(FENCE: tl.constexpr):
    """fence.acq_rel.gpu for this thread (compiled kernels: the interpreter runs programs one at a time)."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _combine_head(m_part, l_part, acc_part, out, b, head, active, stride_ob, stride_oh, H,
                  D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the partial softmaxes of the first `active` splits of output row (b, head) into out (loads from
    L2: the partials are other programs' stores)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < active
    d_ok = offs_d < D
    part = (b.to(tl.int64) * H + head) * NUM_SPLITS + offs_s                            # [BLOCK_S]
    m = tl.load(m_part + part, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_part + part, mask=s_ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(acc_part + part[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0, cache_modifier=".cg")                                     # [BLOCK_S, BLOCK_D]
    w = tl.exp2(m - tl.max(m, 0))                                                       # [BLOCK_S], 0 if inactive
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)                                 # [BLOCK_D]
    tl.store(out + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)


@triton.jit
def _with_delta(ptrs, delta_ptrs, mask, HAS_DELTA: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The values at ptrs in fp32, plus (HAS_DELTA) the fp32 deltas at delta_ptrs rounded to their dtype."""
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        v = _round(v + tl.load(delta_ptrs, mask=mask, other=0.0), ptrs.dtype.element_ty, SOFT_BF16)
    return v


@triton.jit
def _decode_kernel(q, k_cache, v_cache, k_param, v_param, spans, ctx, slopes, out, m_part, l_part, acc_part,
                   counters, k_new, v_new, cos, sin, slots, delta,
                   qk_scale, cap, window, H, stride_qb, stride_qh, stride_ks, stride_kp, stride_kh, stride_vs,
                   stride_vp, stride_vh, stride_ps, stride_pp, stride_ph, stride_sb, stride_ob, stride_oh,
                   stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb, stride_sinb, stride_db,
                   G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   MIN_TILES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_ALIBI: tl.constexpr, QUANT: tl.constexpr,
                   ROTARY: tl.constexpr,
                   COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, FENCE: tl.constexpr, SOFT_BF16: tl.constexpr,
                   PDL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_DELTA: tl.constexpr):
    """Program (b, kv head, split): the G query heads of that kv head over the split's share of the tiles.
    ROTARY: q comes unrotated and is rotated here, and the program of the last split with tiles rotates the new
    token's k (k_new) and writes it and v_new into slot slots[b] of the caches before attending (rotary_store_kv
    and the attention in one launch). Splits past the last with tiles do nothing. Several splits with tiles
    store partial softmaxes; COMBINE: the last of them to finish (a counter per (b, kv head), left at 0 again)
    merges them into out, else _combine_kernel does. HAS_SOFTCAP / HAS_WINDOW: _attend_tiles' soft cap and
    sliding window; with a window the splits share out only the tiles the window reaches. HAS_DELTA (with
    ROTARY): q, k_new and v_new are loaded plus their LoRA deltas (fp32 delta [B, (H + 2 KVH) D], rounded to
    their dtype: the expand's bits, lora_grouped.py) before the rotation."""
    allow_next(PDL)
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(ctx + b).to(tl.int32)
    tile_start, tile_end, active = _split_tiles(n, split, window, NUM_SPLITS, BLOCK_N, HAS_WINDOW, MIN_TILES)
    if split < active:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        head = kv_head * G + offs_g                                                     # [BLOCK_G]
        q_ptrs = q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh             # [BLOCK_G, 1]
        q_ok = g_ok[:, None] & d_ok[None, :]
        if ROTARY:
            half: tl.constexpr = D // 2
            partner = (offs_d + half) % D                                               # rotate_half's element
            sign = tl.where(offs_d < half, -1.0, 1.0)
            c = tl.load(cos + b.to(tl.int64) * stride_cb + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            sn = tl.load(sin + b.to(tl.int64) * stride_sinb + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            d_row = delta + b.to(tl.int64) * stride_db
            q_d = d_row + head[:, None] * D                                             # [BLOCK_G, 1]
            qt = _rotated(_with_delta(q_ptrs + offs_d[None, :], q_d + offs_d[None, :], q_ok, HAS_DELTA, SOFT_BF16),
                          _with_delta(q_ptrs + partner[None, :], q_d + partner[None, :], q_ok, HAS_DELTA, SOFT_BF16),
                          c[None, :], sn[None, :], sign[None, :], q.dtype.element_ty, SOFT_BF16)
            if split == active - 1:      # the split holding position n - 1: the new token's k and v go in first
                slot = tl.load(slots + b).to(tl.int64)
                k_src = k_new + b.to(tl.int64) * stride_knb + kv_head * stride_knh
                k_d = d_row + (H + kv_head) * D
                kt = _rotated(_with_delta(k_src + offs_d, k_d + offs_d, d_ok, HAS_DELTA, SOFT_BF16),
                              _with_delta(k_src + partner, k_d + partner, d_ok, HAS_DELTA, SOFT_BF16), c, sn, sign,
                              k_new.dtype.element_ty, SOFT_BF16)
                k_dst = k_cache + (slot // P) * stride_ks + (slot % P) * stride_kp + kv_head * stride_kh
                tl.store(k_dst + offs_d, kt.to(k_cache.dtype.element_ty), mask=d_ok)
                v_src = v_new + b.to(tl.int64) * stride_vnb + kv_head * stride_vnh + offs_d
                vt = _with_delta(v_src, d_row + (H + H // G + kv_head) * D + offs_d, d_ok, HAS_DELTA, SOFT_BF16)
                vt = vt.to(v_new.dtype.element_ty)
                v_dst = v_cache + (slot // P) * stride_vs + (slot % P) * stride_vp + kv_head * stride_vh
                tl.store(v_dst + offs_d, vt, mask=d_ok)
                tl.debug_barrier()      # the writes are this program's: visible to all its threads after this
        else:
            qt = tl.load(q_ptrs + offs_d[None, :], mask=q_ok, other=0.0)                # [BLOCK_G, BLOCK_D]
        if QUANT == 0:
            qt = qt.to(k_cache.dtype.element_ty)
        elif QUANT != 3:      # int8 / uint4 spans: attended in fp32; fp8's codes meet q in its own dtype
            qt = qt.to(tl.float32)
        pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (n - 1)
        alibi = _alibi_log2(slopes, head, g_ok, HAS_ALIBI)                              # [BLOCK_G]
        acc, m_i, l_i = _attend_tiles(qt, pos, alibi, k_cache, v_cache, k_param, v_param,
                                      spans + b.to(tl.int64) * stride_sb, kv_head, n, tile_start, tile_end,
                                      stride_ks, stride_kp, stride_kh, stride_vs, stride_vp, stride_vh,
                                      stride_ps, stride_pp, stride_ph, qk_scale, cap, window, n - window,
                                      P, D, BLOCK_N, BLOCK_D, DOT_PREC, UPCAST, HAS_ALIBI, QUANT, HAS_SOFTCAP,
                                      HAS_WINDOW)
        if active == 1:
            o_ptrs = out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=q_ok)
        else:
            part = (b.to(tl.int64) * H + head) * NUM_SPLITS + split                     # [BLOCK_G]
            tl.store(m_part + part, m_i, mask=g_ok)
            tl.store(l_part + part, l_i, mask=g_ok)
            tl.store(acc_part + part[:, None] * D + offs_d[None, :], acc, mask=q_ok)
            if COMBINE:
                # every thread's partials out to the GPU before the count; the last to count sees all of them
                _fence(FENCE)
                tl.debug_barrier()
                counter = counters + b * (H // G) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
                    tl.atomic_xchg(counter, 0)
                    _fence(FENCE)
                    for g in range(G):
                        _combine_head(m_part, l_part, acc_part, out, b, kv_head * G + g, active, stride_ob,
                                      stride_oh, H, D, NUM_SPLITS, BLOCK_S, BLOCK_D)


@triton.jit
def _combine_kernel(m_part, l_part, acc_part, out, ctx, window, stride_ob, stride_oh, H,
                    D: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (b, head): merge the partial softmaxes of one output row (when the decode kernel could not)."""
    allow_next(PDL)
    wait_for_previous(PDL)
    b = tl.program_id(0)
    active = _split_tiles(tl.load(ctx + b).to(tl.int32), 0, window, NUM_SPLITS, BLOCK_N, HAS_WINDOW, MIN_TILES)[2]
    if active > 1:
        _combine_head(m_part, l_part, acc_part, out, b, tl.program_id(1), active, stride_ob, stride_oh, H, D,
                      NUM_SPLITS, BLOCK_S, BLOCK_D)


def default_num_splits(batch: int, num_kv_heads: int, max_spans: int, span_size: int) -> int:
    """Split-KV count from shapes only (graph safe): fill ~TARGET_PROGRAMS programs when batch * kv heads is
    small, at most one split per tile the span table can address, and at most MAX_SPLITS."""
    max_tiles = -(-max_spans * span_size // DECODE_BLOCK_N)
    return max(1, min(-(-TARGET_PROGRAMS // (batch * num_kv_heads)), max_tiles, MAX_SPLITS))


MAX_SPLIT_COUNTERS = 1 << 16      # the decode kernel's own merge: a counter a (sequence, kv head) at most


def fused_decode_enabled() -> bool:
    """ALLSPARK_FUSED_DECODE=0: decode attention as three launches again (rotary_store_kv, the attention, the
    split combine), for A/B runs."""
    return settings.FUSED_DECODE.get()


def _split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Zeroed int32 counters, one per (sequence, kv head), for launches on the current stream (stream_counters.py).
    None (the separate combine launch) with fused decode off or more than MAX_SPLIT_COUNTERS needed."""
    if not fused_decode_enabled() or needed > MAX_SPLIT_COUNTERS:
        return None
    return stream_counters("split-combine", device, needed, MAX_SPLIT_COUNTERS)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                           ctx: torch.Tensor, scale: float, num_splits: int | None = None,
                           out: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                           k_param: torch.Tensor | None = None, v_param: torch.Tensor | None = None,
                           rotary: tuple | None = None, launch: dict | None = None, softcap: float = 0.0,
                           window: int = 0, delta: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], caches [S, P, KVH, D], spans [B, MAXS] (int32/int64, padded), ctx [B] (>= 1, incl. the new
    token) -> out [B, H, D] in q's dtype (written into `out` if given). alibi_slopes fp32 [H]: key t's score gets
    slope_h * (t - (ctx - 1)). Quantized caches (quant/kv.py: int8 or fp8 codes, or uint4 codes [S, P, KVH, D/2])
    come with their params fp32 [S, P, KVH, 2]; int8 and uint4 are attended in fp32, fp8's codes (exact in q's
    dtype) meet q on the tensor cores with the rows' scales on the scores and the probabilities.
    rotary = (k [B, KVH, D], v [B, KVH, D], cos, sin [B, (1,) D], slots [B]) (dense caches in q's dtype): q and k
    come unrotated; the launch rotates them as fused_kernels.rotary_store_kv does and writes k and v into the
    caches at slots before attending. delta (with rotary): fp32 [B, (H + 2 KVH) D], the LoRA deltas of q|k|v
    (compute/pending_delta.py), added to q, k and v as the launch loads them.
    launch: the launch shape instead of the defaults (benchmarks/decode_attention_sweep.py): BLOCK_N (tokens a
    tile), num_warps, num_stages. softcap > 0: each score s = scale * q.k becomes softcap * tanh(s / softcap)
    before the bias (Gemma 2). window > 0: the query sees keys t >= ctx - window only (HF's sliding window); keys
    before that are never read (nor their span ids), and the default split count covers the window's tiles."""
    g, span_size, d = _check_inputs(q, k_cache, v_cache, spans)
    quant = {torch.int8: 1, torch.uint8: 2, torch.float8_e4m3fn: 3}.get(k_cache.dtype, 0)
    assert (k_param is not None) == bool(quant) and (v_param is not None) == bool(quant), "params iff quantized"
    if quant:
        assert k_param.shape == v_param.shape == k_cache.shape[:3] + (2,) and k_param.dtype == torch.float32
        assert k_param.stride() == v_param.stride() and k_param.stride(-1) == 1
    batch, heads = q.shape[:2]
    assert ctx.shape == (batch,) and ctx.is_contiguous() and spans.shape[0] == batch
    _check_slopes(alibi_slopes, heads)
    gemma = _gemma_args(scale, softcap, window)
    kvh = k_cache.shape[2]
    if rotary is not None:
        k_new, v_new, cos, sin, slots = rotary
        assert not quant and d % 2 == 0 and k_new.shape == v_new.shape == (batch, kvh, d), "rotary: k, v shapes"
        assert k_new.dtype == v_new.dtype == cos.dtype == sin.dtype == q.dtype == k_cache.dtype, "rotary dtypes"
        assert cos.shape[0] == sin.shape[0] == batch and cos.shape[-1] == sin.shape[-1] == d
        assert all(x.stride(-1) == 1 for x in (k_new, v_new, cos, sin)) and slots.shape == (batch,)
        rot_args = (k_new, v_new, cos, sin, slots, *k_new.stride()[:2], *v_new.stride()[:2], cos.stride(0),
                    sin.stride(0))
    else:
        rot_args = (q, q, q, q, ctx, 0, 0, 0, 0, 0, 0)
    if delta is not None:
        assert rotary is not None and delta.dtype == torch.float32 and delta.stride(-1) == 1, "delta: fp32, rotary"
        assert delta.shape == (batch, (heads + 2 * kvh) * d), f"delta {tuple(delta.shape)}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    rows_as = 1 if row_mode.alone() else batch     # alone-rows mode: each row split as one sequence alone is
    sixteen_bit = not quant and q.element_size() == 2
    large = sixteen_bit and rows_as * kvh >= LARGE_BATCH_PROGRAMS
    invariant = sixteen_bit and row_mode.invariant()
    shape = {"BLOCK_N": DECODE_BLOCK_N, **(LARGE_BATCH_LAUNCH if large else INVARIANT_LAUNCH if invariant else {}),
             **(launch or {})}
    min_tiles = INVARIANT_MIN_TILES if invariant else 1
    if num_splits is None:
        num_splits = default_num_splits(rows_as, kvh, spans.shape[1], span_size)
        if window > 0:      # no more splits than tiles the window's keys can touch
            num_splits = min(num_splits, -(-(window - 1) // shape["BLOCK_N"]) + 1)
    tiles = _tile_config(d, q.dtype if quant == 3 else k_cache.dtype)   # fp8 codes meet q in its dtype
    counters = None
    if num_splits > 1:
        m_part = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)     # [B, H, NS]
        l_part = torch.empty_like(m_part)                                                         # [B, H, NS]
        acc_part = torch.empty(batch, heads, num_splits, d, dtype=torch.float32, device=q.device)  # [B, H, NS, D]
        counters = _split_counters(q.device, batch * kvh)
    else:
        m_part = l_part = acc_part = out        # unused: the kernel writes out directly
    params = (k_param, v_param) if quant else (k_cache, v_cache)
    k_cache, v_cache = kv_quant.byte_view(k_cache), kv_quant.byte_view(v_cache)   # fp8: the kernel bitcasts them
    block_s = triton.next_power_of_2(num_splits)
    launch_pdl = pdl.launch_options(q.device)
    _decode_kernel[(batch, kvh, num_splits)](
        q, k_cache, v_cache, *params, spans, ctx, ctx if alibi_slopes is None else alibi_slopes, out, m_part,
        l_part, acc_part, ctx if counters is None else counters, *rot_args[:5], ctx if delta is None else delta,
        gemma["qk_scale"], gemma["cap"], gemma["window"], heads,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k_param.stride()[:3] if quant else (0, 0, 0)), spans.stride(0), out.stride(0), out.stride(1),
        *rot_args[5:], 0 if delta is None else delta.stride(0), G=g, P=span_size, D=d, NUM_SPLITS=num_splits,
        MIN_TILES=min_tiles, BLOCK_G=max(16, triton.next_power_of_2(g)),
        HAS_ALIBI=alibi_slopes is not None, QUANT=quant, ROTARY=rotary is not None, COMBINE=counters is not None,
        BLOCK_S=block_s, FENCE=not _INTERPRETED, SOFT_BF16=_INTERPRETED, HAS_SOFTCAP=gemma["HAS_SOFTCAP"],
        HAS_WINDOW=gemma["HAS_WINDOW"], HAS_DELTA=delta is not None, **tiles, **shape, **launch_pdl,
        **({"enable_fp_fusion": False} if rotary is not None else {}))
    if num_splits > 1 and counters is None:
        _combine_kernel[(batch, heads)](m_part, l_part, acc_part, out, ctx, gemma["window"], out.stride(0),
                                        out.stride(1), heads, D=d, NUM_SPLITS=num_splits, MIN_TILES=min_tiles,
                                        BLOCK_N=shape["BLOCK_N"], BLOCK_S=block_s, BLOCK_D=tiles["BLOCK_D"],
                                        HAS_WINDOW=gemma["HAS_WINDOW"], **launch_pdl)
    return out
