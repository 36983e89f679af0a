"""The torch reference of every compute op: plain PyTorch on any device, the math each native and CUDA kernel is
tested against and falls back to (compute/ops.py dispatches; compute/cuda/cuda_ops.py builds on these). Roundings follow
HF's eager modules: sums and normalized rows in the activation dtype, statistics in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from allspark_server.compute import alibi
from allspark_server.compute.lora_slots import lora_add_reference
from allspark_server.compute.steps import Attention, Mlp
from allspark_server.quant import kv as kv_quant
from allspark_server.quant.formats import FP8_MAX, QuantizedWeight

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


def fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as an FP8 x FP8 matmul meets it (fp8_e4m3 weights with activate_quant): (codes float8_e4m3fn
    [M, K], scales fp32 [M, 1]), each row's scale the power of two 2^ceil(log2(max|x| / 448)) (1 for a row of
    zeros). A power of two keeps e4m3's relative precision (its grid is a float's) and makes code x scale, x
    rounded to that grid to nearest even, exact in bf16, fp16 and fp32: a GEMV fed those values computes the
    products a scaled matmul of the codes does."""
    xf = x.float()
    mantissa, exponent = torch.frexp(xf.abs().amax(-1, keepdim=True) / FP8_MAX)    # m in [0.5, 1) (0 for 0)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)                  # an exact power of two
    one = torch.ones_like(mantissa)
    scale = torch.where(mantissa == 0, one, torch.ldexp(one, exponent))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


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
                               ctx: torch.Tensor, options: Attention, k_param: torch.Tensor | None = None,
                               v_param: torch.Tensor | None = None,
                               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D], caches [S, P, KVH, D], spans [B, MAXS], ctx [B] -> [B, H, D];
    options: the layer's Attention step (its scale, softcap and window).
    Quantized caches (k_param/v_param given, quant/kv.py) are dequantized and attended in fp32. alibi_slopes
    [H] fp32: key t's score gets slope_h * (t - (ctx - 1)) (compute/alibi.py), attended in fp32 (or q's wider
    dtype). Gemma 2: softcap > 0 turns each score s = scale * q.k into softcap * tanh(s / softcap) before the bias;
    window > 0 keeps only the keys t >= ctx - window (HF's sliding window: (ctx - 1) - t < window). Either one set:
    the attention is computed here in fp32 (or q's wider dtype), scores, softmax and the weighted sum, rather than
    through SDPA."""
    scale, softcap, window = options.scale, options.softcap, options.window
    if softcap < 0 or window < 0:
        raise ValueError(f"softcap and window must be >= 0, not {softcap}, {window}")
    if softcap > 0 or window > 0:
        return _decode_attention_explicit(q, k_cache, v_cache, spans, ctx, scale, k_param, v_param, alibi_slopes,
                                          softcap, window)
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


def _decode_attention_explicit(q, k_cache, v_cache, spans, ctx, scale, k_param, v_param, alibi_slopes, softcap,
                               window) -> torch.Tensor:
    """decode_attention_reference with soft-capping and / or a sliding window, spelled out in fp32 (or q's wider
    dtype): scores = scale * q.k over the keys in the window, capped, plus the ALiBi bias of the keys' true
    positions, softmax, weighted sum of V, one rounding into q's dtype. Only the window's cache slots are read."""
    span_size, kvh = k_cache.shape[1:3]
    group = q.shape[1] // kvh
    work = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        first = n - window if 0 < window < n else 0
        pos = torch.arange(first, n, device=k_cache.device)                             # the keys attended
        slots = spans[b, pos // span_size] * span_size + pos % span_size
        k, v = gather_kv(k_cache, v_cache, slots, k_param, v_param, work)              # [m, KVH, D]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)            # [m, H, D]
        s = torch.einsum("hd,mhd->hm", q[b].to(work), k) * scale                       # [H, m]
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if alibi_slopes is not None:
            s = s + alibi.decode_bias(alibi_slopes, n, work)[:, 0, first:]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hm,mhd->hd", p, v).to(q.dtype)
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                                options: Attention, out: torch.Tensor, k_param: torch.Tensor | None = None,
                                v_param: torch.Tensor | None = None,
                                alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Each multi-token chunk of `meta.seqs` (step/inputs.py) on its own: q [T, H, D] rows of the chunk
    against its context gathered from the spans (K/V already stored; quantized spans dequantized), causal and offset
    by the tokens cached before it -> written into out [T, H, D]. ALiBi (slopes fp32 [H]): with the bias. softcap /
    window (options, the layer's Attention step): HF's eager attention with the cap and the sliding window."""
    scale, softcap, window = options.scale, options.softcap, options.window
    gqa = q.shape[1] != k_cache.shape[2]
    for seq in meta.seqs:
        qs = q[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)[None]    # [1, h, q, D]
        slots = seq.context_slots.to(q.device, non_blocking=True)
        k_ctx, v_ctx = gather_kv(k_cache, v_cache, slots, k_param, v_param, q.dtype)
        ks, vs = k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None]    # [1, kvh, ctx, D]
        if softcap or window:
            o = capped_window_attention(qs, ks, vs, scale, softcap, window)   # [1, h, q, D]
        elif alibi_slopes is not None:     # the causal part from the chunk's offset, plus the bias
            o = alibi.prefill_attention(qs, ks, vs, alibi_slopes, scale)      # [1, h, q, D]
        else:
            mask = None if seq.mask is None else seq.mask.to(q.device, non_blocking=True)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=seq.is_causal, scale=scale,
                                               enable_gqa=gqa)                 # [1, h, q, D]
        out[seq.q_start:seq.q_start + seq.q_len] = o[0].transpose(0, 1)
    return out


def capped_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                            window: int) -> torch.Tensor:
    """HF Gemma 2's eager attention for a chunk: q [1, h, q, D] at the last q of the n context positions, k/v
    [1, kvh, n, D]: scores (q.k) * scale in q's dtype, soft-capped (softcap > 0), causal and within the sliding
    window (window > 0: p - j < window), softmax in fp32 rounded to q's dtype, times v -> [1, h, q, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale                    # [1, h, q, n]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n, rows = k.shape[2], q.shape[2]
    pos = torch.arange(n - rows, n, device=q.device)[:, None]              # each row's position
    key = torch.arange(n, device=q.device)[None]
    hidden = key > pos
    if window:
        hidden |= pos - key >= window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_param: torch.Tensor | None = None,
              v_param: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """The K and V rows of cache slots [n] as [n, KVH, D] in `dtype` (quantized caches dequantized)."""
    kvh = k_cache.shape[2]
    rows = []
    for cache, param in ((k_cache, k_param), (v_cache, v_param)):
        x = kv_quant.byte_view(cache).view(-1, kvh, cache.shape[-1])[slots].view(cache.dtype)
        if param is not None:
            x = kv_quant.dequantize_rows(x, param.view(-1, kvh, 2)[slots], kv_quant.mode_of(cache))
        rows.append(x if dtype is None else x.to(dtype))
    return rows[0], rows[1]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's `act(gate) * up` on the merged [T, 2I] projection -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma 2's `gelu_pytorch_tanh(gate) * up` on the merged [T, 2I] projection -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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
        kv_quant.byte_view(cache).view(-1, kvh, cache.shape[-1]).index_copy_(0, slots, kv_quant.byte_view(codes))
        param.view(-1, kvh, 2).index_copy_(0, slots, params)


def _lora_linear(x: torch.Tensor, w, bias, lora, lora_rows) -> torch.Tensor:
    """linear_reference plus each row's LoRA delta (compute/lora_slots.py) where the projection has adapters."""
    y = linear_reference(x, w, bias)
    return y if lora is None or lora_rows is None else lora_add_reference(y, x, lora, lora_rows, linear_reference)


def attention_step_reference(x: torch.Tensor, b, slots: torch.Tensor, spans: torch.Tensor, ctx: torch.Tensor,
                             cos: torch.Tensor | None, sin: torch.Tensor | None, lora_rows=None) -> torch.Tensor:
    """A BoundAttention step (compute/steps.py) on decode rows x [B, H]: q|k|v projection, q/k norms per head,
    rotary (cos/sin [B, 1, D]; None for ALiBi), cache write, decode attention, o projection -> the o projection's
    output before any allreduce; lora_rows: the rows' LoRA adapters (compute/lora_slots.py LoraRows)."""
    a = b.step
    qkv = _lora_linear(x, b.qkv, b.qkv_bias, b.qkv_lora, lora_rows)
    n, d = x.shape[0], qkv.shape[-1] // (b.num_heads + 2 * b.num_kv_heads)
    q, k, v = qkv.split([b.num_heads * d, b.num_kv_heads * d, b.num_kv_heads * d], -1)
    if b.q_norm is not None:
        q = rms_norm_reference(q.reshape(-1, d), b.q_norm, b.norm_eps)[0]
        k = rms_norm_reference(k.reshape(-1, d), b.k_norm, b.norm_eps)[0]
    q, k = q.reshape(n, b.num_heads, d), k.reshape(n, b.num_kv_heads, d)
    if cos is not None:
        q, k = rotary_reference(q, k, cos, sin)
    store_kv_reference(k, v, b.k_cache, b.v_cache, slots, b.k_param, b.v_param)
    o = decode_attention_reference(q, b.k_cache, b.v_cache, spans, ctx, a, b.k_param, b.v_param, b.alibi_slopes)
    return _lora_linear(o.reshape(n, b.num_heads * d), b.o, None, b.o_lora, lora_rows)


def act_mul_reference(gate_up: torch.Tensor, options: Mlp) -> torch.Tensor:
    """An Mlp step's act(gate) * up on the merged [T, 2I] projection (options.act: compute/steps.py ACTIVATIONS)."""
    return silu_mul_reference(gate_up) if options.act == "silu" else gelu_tanh_mul_reference(gate_up)


def mlp_step_reference(x: torch.Tensor, b, lora_rows=None) -> torch.Tensor:
    """A BoundMlp step: gate|up projection, act(gate) * up, down projection (before any allreduce)."""
    a = act_mul_reference(_lora_linear(x, b.gate_up, b.gate_up_bias, b.gate_up_lora, lora_rows), b.step)
    return _lora_linear(a, b.down, None, b.down_lora, lora_rows)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (fp32 weights [T, k], expert ids [T, k]): softmax in fp32, top k, renormalized."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
