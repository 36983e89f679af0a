"""Attention over the span KV cache: write this step's K/V into their slots, then attend.

One-token (decode) sequences go through one `ops.decode_attention` call that reads keys and
values straight from the spans (dense or quantized: quant/kv.py). Multi-token chunks (prefill)
gather their context (dequantized to the activation dtype for quantized spans) and run
scaled-dot-product attention, causal and offset by the tokens already cached (ALiBi models: with their
bias, layers/alibi.py). Every sequence is computed on its own, so a request's numbers do not depend on
its batch neighbours. Steps with no prefill chunk at all skip this module: the decoder runs them
through the fused decode blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from allspark_server import ops
from allspark_server.layers import alibi
from allspark_server.runner.forward_inputs import AttentionMetadata
from allspark_server.runner.kv_cache import LayerKV


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, alibi_slopes: torch.Tensor | None = None):
        """alibi_slopes: fp32 [num_heads], this rank's heads' ALiBi slopes (None: no position bias)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)     # [h] or None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, h, D], k/v [T, kvh, D]; kv: this layer's cache (runner/kv_cache.py). Returns [T, h*D]."""
        ops.store_kv(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_param, kv.v_param)
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            out[meta.decode_rows] = ops.decode_attention(q[meta.decode_rows], kv.k, kv.v, meta.decode_spans,
                                                         meta.decode_ctx, self.scale, kv.k_param,
                                                         kv.v_param, self.alibi_slopes)       # [B, h, D]
        gqa = self.num_heads != self.num_kv_heads
        for seq in meta.seqs:
            qs = q[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)[None]   # [1, h, q, D]
            k_ctx, v_ctx = ops.gather_kv(kv.k, kv.v, seq.context_slots, kv.k_param, kv.v_param, q.dtype)
            ks = k_ctx.transpose(0, 1)[None]                                     # [1, kvh, ctx, D]
            vs = v_ctx.transpose(0, 1)[None]
            if self.alibi_slopes is not None:       # the causal part from the chunk's offset, plus the bias
                o = alibi.prefill_attention(qs, ks, vs, self.alibi_slopes, self.scale)      # [1, h, q, D]
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, is_causal=seq.is_causal,
                                                   scale=self.scale, enable_gqa=gqa)  # [1, h, q, D]
            out[seq.q_start:seq.q_start + seq.q_len] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
