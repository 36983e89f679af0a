"""KV cache tensors: per layer, K and V pages of shape [num_spans, span_size, kv_heads_local, head_dim],
in host memory (huge pages where the kernel gives them) or on the rank's GPU.

Sizes the number of spans from a byte budget. A quantized cache (kv_cache_mode int8 / uint4 / fp8,
quant/kv.py has the row format) holds codes in the pages and a (scale, zero) pair per token and
head beside them; `bytes_per_span` counts both, so the same budget holds ~1.9x (int8, fp8) or ~3.6x
(uint4) the tokens of a bf16 cache at head_dim 128.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from allspark_client import settings
from allspark_server.compute.device_kind import in_host_memory
from allspark_server.quant import kv as kv_quant
from allspark_server.step import hugepages


class LayerKV(NamedTuple):
    """One layer's cache as the attention ops take it: pages k, v and, when quantized, their params."""
    k: torch.Tensor                          # [S, P, KVH, D] activation dtype | int8 / fp8 [.., D] | uint8 [.., D/2]
    v: torch.Tensor
    k_param: Optional[torch.Tensor] = None   # fp32 [S, P, KVH, 2]: (scale, zero) of each row
    v_param: Optional[torch.Tensor] = None

    @property
    def mode(self) -> str | None:
        """None (the activation dtype), 'int8', 'uint4' or 'fp8'."""
        return None if self.k_param is None else kv_quant.mode_of(self.k)


def bytes_per_span(num_layers: int, span_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   mode: str | None = None) -> int:
    return 2 * num_layers * span_size * num_kv_heads * kv_quant.bytes_per_row(mode, head_dim, dtype)


class KVCache:
    def __init__(self, num_layers: int, num_spans: int, span_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, mode: str | None = None, device: torch.device = torch.device("cpu"),
                 pinned: bool = False):
        self.num_spans, self.span_size, self.mode = num_spans, span_size, mode
        rows = (num_spans, span_size, num_kv_heads)
        if mode is None:
            specs = {f"{kv}{i}": (rows + (head_dim,), dtype) for i in range(num_layers) for kv in "kv"}
        else:
            code = (rows + (kv_quant.code_width(mode, head_dim),), kv_quant.code_dtype(mode))
            specs = {}
            for i in range(num_layers):
                for kv in "kv":
                    specs[f"{kv}{i}"] = code
                    specs[f"{kv}p{i}"] = (rows + (2,), torch.float32)
        if pinned:   # host memory a GPU copies to and from asynchronously
            pages = {name: torch.zeros(shape, dtype=dt, pin_memory=True) for name, (shape, dt) in specs.items()}
        elif in_host_memory(device):
            pages = hugepages.zeros(specs, populate=settings.KV_PREFAULT.get())
        else:
            pages = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in specs.items()}
        self.layers = [LayerKV(pages[f"k{i}"], pages[f"v{i}"], pages.get(f"kp{i}"), pages.get(f"vp{i}"))
                       for i in range(num_layers)]


def copy_spans(src: KVCache, src_ids: list[int], dst: KVCache, dst_ids: list[int]) -> None:
    """Spans dst_ids of `dst` get the content of spans src_ids of `src` (every layer: K, V and their quantization
    params), across devices (the prefix cache's second tier: GPU or host pages <-> host slots)."""
    for a, b in zip(src.layers, dst.layers):
        si = torch.tensor(src_ids, dtype=torch.long, device=a.k.device)
        di = torch.tensor(dst_ids, dtype=torch.long, device=b.k.device)
        for x, y in zip(a, b):
            if x is not None:
                x, y = kv_quant.byte_view(x), kv_quant.byte_view(y)
                # to a GPU: stream-ordered before the step reads it; to the host: blocking (the slot is read later)
                y.index_copy_(0, di, x.index_select(0, si).to(y.device, non_blocking=not in_host_memory(y)))
