"""The torch reference of every compute op: plain PyTorch on any device, the math each native and CUDA kernel is
tested against and falls back to (compute/ops.py dispatches; compute/cuda/ops.py builds on these). Roundings follow
HF's eager modules: sums and normalized rows in the activation dtype, statistics in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from allspark_server.compute import alibi
from allspark_server.quant import kv as kv_quant
from allspark_server.quant.formats import QuantizedWeight


ACT_MAX = {16: 32767.0, 8: 127.0}     # QuantizedWeight.act_bits -> the largest |q| of a rounded row of x


def round_activations_reference(x: torch.Tensor, act_bits: int = 16) -> torch.Tensor:
    """x [M, K] as the quantized GEMV meets it (native/gemv_quant.cpp): each row rounded to fixed point,
    q = round(x * A / absmax) (half to even), times absmax / A, with A = 32767 (16 bits, weight-only) or 127
    (8 bits, activate_quant); fp32 [M, K]."""
    act_max = ACT_MAX[act_bits]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division, as the kernels compute it (torch's `scalar / tensor` is reciprocal * scalar, which rounds
    # differently for ~1/4 of values and can then round an element of q the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, act_max) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv) * (amax / act_max)


def linear_reference(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized weight is dequantized (quant/formats.py) and met in fp32 with x rounded as the quantized
    GEMV rounds it; one rounding into x's dtype."""
    if isinstance(w, QuantizedWeight):
        y = F.linear(round_activations_reference(x, w.act_bits), w.dequantize(),
                     None if bias is None else bias.float())
        return y.to(x.dtype)
    return F.linear(x, w, bias)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(s), s) with s = x + residual (or x), rounded where HF Llama/Qwen2 round:
    the sum and the normalized rows in the activation dtype, statistics in fp32."""
    s = x if residual is None else x + residual
    normed = F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)
    return weight * normed, s


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, h, D], k [T, kvh, D] rotated by cos/sin [T, 1, D]: HF's x * cos + rotate_half(x) * sin."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                               ctx: torch.Tensor, scale: float, k_param: torch.Tensor | None = None,
                               v_param: torch.Tensor | None = None,
                               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D], caches [S, P, KVH, D], spans [B, MAXS], ctx [B] -> [B, H, D].
    Quantized caches (k_param/v_param given, quant/kv.py) are dequantized and attended in fp32. alibi_slopes
    [H] fp32: key t's score gets slope_h * (t - (ctx - 1)) (layers/alibi.py), attended in fp32 (or q's wider
    dtype)."""
    span_size, kvh = k_cache.shape[1:3]
    out = torch.empty_like(q)
    offsets = torch.arange(span_size, device=k_cache.device)
    wide = k_param is not None or alibi_slopes is not None
    work = torch.promote_types(q.dtype, torch.float32) if wide else q.dtype
    for b in range(q.shape[0]):
        n = int(ctx[b])
        slots = (spans[b, :-(-n // span_size)][:, None] * span_size + offsets).reshape(-1)[:n]
        k, v = gather_kv(k_cache, v_cache, slots, k_param, v_param, work)
        bias = None if alibi_slopes is None else alibi.decode_bias(alibi_slopes, n, work)[None]   # [1, H, 1, n]
        o = F.scaled_dot_product_attention(q[b][None, :, None].to(work), k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=bias, scale=scale,
                                           enable_gqa=kvh != q.shape[1])        # [1, H, 1, D]
        out[b] = o[0, :, 0].to(q.dtype)
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                                out: torch.Tensor, k_param: torch.Tensor | None = None,
                                v_param: torch.Tensor | None = None,
                                alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Each multi-token chunk of `meta.seqs` (runner/forward_inputs.py) on its own: q [T, H, D] rows of the chunk
    against its context gathered from the spans (K/V already stored; quantized spans dequantized), causal and offset
    by the tokens cached before it -> written into out [T, H, D]. ALiBi (slopes fp32 [H]): with the bias."""
    gqa = q.shape[1] != k_cache.shape[2]
    for seq in meta.seqs:
        qs = q[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)[None]    # [1, h, q, D]
        slots = seq.context_slots.to(q.device, non_blocking=True)
        k_ctx, v_ctx = gather_kv(k_cache, v_cache, slots, k_param, v_param, q.dtype)
        ks, vs = k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None]    # [1, kvh, ctx, D]
        if alibi_slopes is not None:       # the causal part from the chunk's offset, plus the bias
            o = alibi.prefill_attention(qs, ks, vs, alibi_slopes, scale)      # [1, h, q, D]
        else:
            mask = None if seq.mask is None else seq.mask.to(q.device, non_blocking=True)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=seq.is_causal, scale=scale,
                                               enable_gqa=gqa)                 # [1, h, q, D]
        out[seq.q_start:seq.q_start + seq.q_len] = o[0].transpose(0, 1)
    return out


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_param: torch.Tensor | None = None,
              v_param: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """The K and V rows of cache slots [n] as [n, KVH, D] in `dtype` (quantized caches dequantized)."""
    kvh = k_cache.shape[2]
    rows = []
    for cache, param in ((k_cache, k_param), (v_cache, v_param)):
        x = cache.view(-1, kvh, cache.shape[-1])[slots]
        if param is not None:
            x = kv_quant.dequantize_rows(x, param.view(-1, kvh, 2)[slots], kv_quant.mode_of(cache))
        rows.append(x if dtype is None else x.to(dtype))
    return rows[0], rows[1]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's `act(gate) * up` on the merged [T, 2I] projection -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, k_param: torch.Tensor | None = None,
                       v_param: torch.Tensor | None = None) -> None:
    """Write k, v [T, KVH, D] (or [T, KVH * D]) into cache slots [T] of caches [S, P, KVH, D]; quantized
    caches (k_param/v_param given) get the rows' codes and (scale, zero) params (quant/kv.py)."""
    kvh = k_cache.shape[2]
    for x, cache, param in ((k, k_cache, k_param), (v, v_cache, v_param)):
        if param is None:
            cache.view(-1, kvh, cache.shape[-1]).index_copy_(0, slots, x.reshape(-1, kvh, cache.shape[-1]))
            continue
        codes, params = kv_quant.quantize_rows(x.reshape(slots.shape[0], kvh, -1), kv_quant.mode_of(cache))
        cache.view(-1, kvh, cache.shape[-1]).index_copy_(0, slots, codes)
        param.view(-1, kvh, 2).index_copy_(0, slots, params)


def decode_attention_block_reference(x, residual, norm_weight, eps, qkv_weight, qkv_bias, num_heads, num_kv_heads,
                                     cos, sin, k_cache, v_cache, slots, spans, ctx, scale, o_weight,
                                     k_param=None, v_param=None, q_norm=None, k_norm=None, alibi_slopes=None):
    """The unfused ops in sequence: norm(x + residual), q|k|v projection, (q/k norms per head,) rotary, cache
    write, decode attention, o projection. Returns (o . W_o^T before any allreduce, x + residual).
    cos = sin = None: no rotary (ALiBi models, whose alibi_slopes [heads] go to the attention)."""
    h, s = rms_norm_reference(x, norm_weight, eps, residual)
    qkv = linear_reference(h, qkv_weight, qkv_bias)
    b, d = x.shape[0], qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    if q_norm is not None:
        q, k = rms_norm_reference(q.reshape(-1, d), q_norm, eps)[0], rms_norm_reference(k.reshape(-1, d), k_norm, eps)[0]
    q, k = q.reshape(b, num_heads, d), k.reshape(b, num_kv_heads, d)
    if cos is not None:
        q, k = rotary_reference(q, k, cos, sin)
    store_kv_reference(k, v, k_cache, v_cache, slots, k_param, v_param)
    o = decode_attention_reference(q, k_cache, v_cache, spans, ctx, scale, k_param, v_param, alibi_slopes)
    return linear_reference(o.reshape(b, num_heads * d), o_weight), s


def decode_mlp_block_reference(x, residual, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight):
    """norm(x + residual), gate|up projection, silu(gate) * up, down projection: (down output, x + residual)."""
    h, s = rms_norm_reference(x, norm_weight, eps, residual)
    return linear_reference(silu_mul_reference(linear_reference(h, gate_up_weight, gate_up_bias)), down_weight), s


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (fp32 weights [T, k], expert ids [T, k]): softmax in fp32, top k, renormalized."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
