"""Attention over the span KV cache: write this step's K/V into their slots, then attend.

One-token (decode) sequences go through one `ops.decode_attention` call that reads keys and
values straight from the spans. Multi-token chunks (prefill) gather their context and run
scaled-dot-product attention, causal and offset by the tokens already cached. Every sequence is
computed on its own, so a request's numbers do not depend on its batch neighbours. Steps with no
prefill chunk at all skip this module: the decoder runs them through the fused decode blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from allspark_server import ops
from allspark_server.runner.forward_inputs import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, h, D], k/v [T, kvh, D]; caches [num_spans, span_size, kvh, D]. Returns [T, h*D]."""
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)   # [S*span, kvh, D]
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            out[meta.decode_rows] = ops.decode_attention(q[meta.decode_rows], k_cache, v_cache, meta.decode_spans,
                                                         meta.decode_ctx, self.scale)       # [B, h, D]
        gqa = self.num_heads != self.num_kv_heads
        for seq in meta.seqs:
            qs = q[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)[None]   # [1, h, q, D]
            ks = k_flat[seq.context_slots].transpose(0, 1)[None]                 # [1, kvh, ctx, D]
            vs = v_flat[seq.context_slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, is_causal=seq.is_causal,
                                               scale=self.scale, enable_gqa=gqa)  # [1, h, q, D]
            out[seq.q_start:seq.q_start + seq.q_len] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
