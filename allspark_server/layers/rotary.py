"""Rotary position embedding with HF's rope types: default, linear and llama3 frequency scaling.

Builds a cos/sin table once (fp32, like HF, then cast to the activation dtype); each step looks up
its positions' rows once and every layer applies them with `ops.rotary` (q and k in one call).
Unknown rope types are rejected when the model is built.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32 for the given rope scaling dict (HF's keys)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]                  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                    # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The [T, 1, D] cos and sin rows of `positions`, in `dtype` (once per step, shared by all layers)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

