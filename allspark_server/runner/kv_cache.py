"""KV cache tensors: per layer, K and V pages of shape [num_spans, span_size, kv_heads_local, head_dim].

Sizes the number of spans from a byte budget. Quantized spans (int8/uint4) will add per-token,
per-head scale and zero tensors beside each page; `bytes_per_span` is where their cost goes.
"""
from __future__ import annotations

import torch

from allspark_server.runner import hugepages


def bytes_per_span(num_layers: int, span_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * span_size * num_kv_heads * head_dim * elem


class KVCache:
    def __init__(self, num_layers: int, num_spans: int, span_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.num_spans, self.span_size = num_spans, span_size
        shape = (num_spans, span_size, num_kv_heads, head_dim)
        pages = hugepages.zeros({f"{kv}{i}": (shape, dtype) for i in range(num_layers) for kv in "kv"})
        self.k = [pages[f"k{i}"] for i in range(num_layers)]
        self.v = [pages[f"v{i}"] for i in range(num_layers)]
