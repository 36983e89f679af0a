"""Attention over the span KV cache: write this step's K/V into their slots (rotated first, in the same op), then
attend.

One-token (decode) sequences go through one `ops.decode_attention` call that reads keys and
values straight from the spans (dense or quantized: quant/kv.py). Multi-token chunks (prefill)
gather their context (dequantized to the activation dtype for quantized spans) and run
scaled-dot-product attention, causal and offset by the tokens already cached (ALiBi models: with their
bias, compute/alibi.py; soft-capped scores and sliding windows: the Attention step's options, compute/steps.py);
on a GPU all chunks of a step are one varlen kernel launch over the spans. Every sequence is computed on its own,
so a request's numbers do not depend on its batch neighbours. Steps with no prefill chunk at all skip this module:
the decoder runs them as the layer description's steps (compute/step_ops.py).
"""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.compute import ops
from allspark_server.compute.steps import Attention
from allspark_server.step.inputs import AttentionMetadata
from allspark_server.step.kv_cache import LayerKV


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, step: Attention,
                 alibi_slopes: torch.Tensor | None = None):
        """step: the layer description's options (scale, softcap, sliding window); alibi_slopes: fp32
        [num_heads], this rank's heads' ALiBi slopes (None: no position bias)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.step = step
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)     # [h] or None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                meta: AttentionMetadata, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, h, D], k/v [T, kvh, D]; kv: this layer's cache (step/kv_cache.py); rope: the rows' (cos, sin),
        which rotate q and k first, in one op with the cache write (None: q and k as they are). Returns [T, h*D]."""
        if rope is not None:
            q = ops.rotary_store_kv(q, k, v, *rope, kv.k, kv.v, meta.slot_mapping, kv.k_param, kv.v_param)
        else:
            ops.store_kv(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_param, kv.v_param)
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            out[meta.decode_rows] = ops.decode_attention(q[meta.decode_rows], kv.k, kv.v, meta.decode_spans,
                                                         meta.decode_ctx, self.step, kv.k_param,
                                                         kv.v_param, self.alibi_slopes)  # [B, h, D]
        if meta.seqs:
            ops.prefill_attention(q, kv.k, kv.v, meta, self.step, out, kv.k_param, kv.v_param, self.alibi_slopes)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
