"""ALiBi (Press et al. 2022, "Train Short, Test Long"): a per-head linear bias on the attention scores in place of
a rotary, score[h, i, j] += slope_h * (j - i) for query position i and key position j <= i (Baichuan2-13B adds
slope_h * j, the same under softmax; the relative form keeps the numbers small).

Owns the slopes (per model, and each tensor-parallel rank's share) and the prefill attention with the bias; the
decode kernels (ops.decode_attention, the fused decode blocks) take the slopes and add the bias themselves.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# bytes of fp32 bias one prefill attention call builds at most (heads are taken a KV group at a time beyond it)
PREFILL_BIAS_BYTES = 64 << 20


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """fp32 [num_heads]. A power of two n: head h (0-based) gets 2^(-8 (h + 1) / n). Otherwise, with p the largest
    power of two below n: the p slopes of p heads, then 2^(-8 (2k + 1) / (2p)) for k < n - p (the 1st, 3rd, 5th
    ... slopes of 2p heads), as the paper's reference code and Baichuan's `_get_interleave` do."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, not {num_heads}")
    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    slopes += [2.0 ** (-8.0 * (2 * k + 1) / (2 * p)) for k in range(num_heads - p)]
    return torch.tensor(slopes, dtype=torch.float32)


def local_slopes(num_heads: int, heads: tuple[int, int]) -> torch.Tensor:
    """The slopes of one tensor-parallel rank's heads [lo, hi) (layers/sharding.py TPLayout.head_range),
    fp32 [hi - lo]."""
    return alibi_slopes(num_heads)[heads[0]:heads[1]].clone()


def prefill_bias(slopes: torch.Tensor, q_len: int, ctx_len: int) -> torch.Tensor:
    """[h, q_len, ctx_len] in fp32 (or the slopes' wider dtype): slope_h * (j - i) where key j may be attended,
    -inf above the diagonal. Query i of the chunk sits at position ctx_len - q_len + i (the tokens before it are
    already cached)."""
    device, dtype = slopes.device, torch.promote_types(slopes.dtype, torch.float32)
    rel = (torch.arange(ctx_len, device=device)[None, :]
           - torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]).to(dtype)       # [q, ctx], j - i
    bias = slopes.to(dtype)[:, None, None] * rel                                              # [h, q, ctx]
    return bias.masked_fill_(rel > 0, float("-inf"))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention with the ALiBi bias: q [1, h, q, D], k/v [1, kvh, ctx, D] -> [1, h, q, D] in q's dtype.
    Computed in fp32 (at least): a bf16 bias could not hold slope * (j - i) to better than ~1/256 of it. Whole KV
    groups at a time, so the bias built per call stays under PREFILL_BIAS_BYTES."""
    heads, q_len, kvh, ctx_len = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    group = heads // kvh
    work = torch.promote_types(q.dtype, torch.float32)
    per_call = max(1, PREFILL_BIAS_BYTES // max(1, group * q_len * ctx_len * 4))     # KV heads per SDPA call
    out = torch.empty_like(q)
    for lo in range(0, kvh, per_call):
        hi = min(kvh, lo + per_call)
        bias = prefill_bias(slopes[lo * group:hi * group], q_len, ctx_len).to(work)   # [hb, q, ctx]
        o = F.scaled_dot_product_attention(q[:, lo * group:hi * group].to(work), k[:, lo:hi].to(work),
                                           v[:, lo:hi].to(work), attn_mask=bias[None], scale=scale,
                                           enable_gqa=group > 1)                        # [1, hb, q, D]
        out[:, lo * group:hi * group] = o.to(q.dtype)
    return out


def decode_bias(slopes: torch.Tensor, ctx_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[h, 1, ctx_len] in `dtype`: the bias of one query at position ctx_len - 1, slope_h * (j - (ctx_len - 1))."""
    rel = torch.arange(ctx_len, device=slopes.device, dtype=dtype) - (ctx_len - 1)
    return (slopes.to(dtype)[:, None] * rel)[:, None, :]
