"""Rotary position embedding with HF's rope types: default, linear, llama3 and yarn frequency scaling, and dynamic
NTK up to the model's context (dynamic_rope_limit); full or partial (the first rotary_dim/2 pairs, in the layout
of models/convert.py).

Builds a cos/sin table once (fp32, like HF, then cast to the activation dtype), for the positions the KV
cache can hold (`fit`), not for max_length; each step looks up
its positions' rows once and every layer applies them with `ops.rotary_store_kv` (q and k in one call, with
the cache write; decode steps: their step ops).
Unknown rope types are rejected when the model is built.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by `factor`), those turning more than
    beta_fast times kept, a linear ramp over the dims between; cos and sin scaled by 0.1 ln(factor) + 1 (or the
    config's attention_factor / mscale ratio)."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:     # the dim whose frequency turns `rotations` times over old_ctx
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                            # 1: the original frequency, 0: interpolated
    blended = (inv_freq / factor) * (1 - keep) + inv_freq * keep

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale(1.0)
    return blended, float(attention)


def rope_frequencies(dim: int, theta: float, scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] in fp32 for the given rope scaling dict (HF's keys), and the factor cos and
    sin are multiplied by (1 but for yarn)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", "dynamic"):   # dynamic: as default up to the original context (RotaryEmbedding)
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, dim, theta, scaling)
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
        return torch.where(in_band, blended, scaled), 1.0
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def dynamic_rope_limit(scaling: Optional[dict], max_position_embeddings: int) -> Optional[int]:
    """Dynamic NTK scaling changes every frequency as a sequence grows past the model's context, which keys
    already in the KV cache cannot follow: such a model serves up to that context, where it is exact."""
    if (scaling or {}).get("rope_type") == "dynamic":
        return int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    return None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict],
                 rotary_dim: int = 0, mrope_section: tuple = ()):
        """`rotary_dim` < head_dim (partial rotary): pair i < rotary_dim/2 rotates dims (i, i + head_dim/2) at the
        frequencies of a rotary_dim-wide rope; every other dim gets cos 1, sin 0, so it passes unchanged (x * 1 +
        y * 0 is exact in any dtype).

        The table is not built here: its rows for max_positions (max_length) could be gigabytes that the KV
        budget never counts (2^24 positions of a 64-wide head: 8 GiB). `fit(n)` builds the rows 0..n-1 (the
        runner: the positions its KV cache can hold); a table never fitted is built for max_positions when first
        used."""
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.rotary_dim = rotary_dim or head_dim
        self.inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling)
        # M-RoPE: which of a 3-D position's components (temporal, height, width) turns each column ([D] long)
        self.mrope_sections = None
        if mrope_section:
            pairs = [i for i, n in enumerate(mrope_section) for _ in range(n)]
            pairs += [0] * (head_dim // 2 - len(pairs))               # columns past the rotary dims: cos 1, sin 0
            self.mrope_sections = torch.tensor(pairs + pairs, dtype=torch.long, device="cpu")
        self.register_buffer("_cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("_sin", torch.empty(0, head_dim), persistent=False)

    @property
    def cos(self) -> torch.Tensor:
        if not len(self._cos):
            self.fit(self.max_positions)
        return self._cos

    @property
    def sin(self) -> torch.Tensor:
        if not len(self._sin):
            self.fit(self.max_positions)
        return self._sin

    def fit(self, positions: int) -> None:
        """The table's rows for positions 0 .. min(positions, max_positions) - 1, on the table's device. Built on
        the host in chunks (each row as the whole table's would be: the ops are elementwise), so what it costs
        besides the table is a chunk's."""
        n = max(1, min(positions, self.max_positions))
        if len(self._cos) == n:
            return
        device = self._cos.device
        like = {"device": device, "dtype": self._cos.dtype}
        self._cos = self._sin = None                        # the old table goes before the new one is built
        cos, sin = torch.ones(n, self.head_dim, **like), torch.zeros(n, self.head_dim, **like)
        half, pairs, chunk = self.head_dim // 2, self.rotary_dim // 2, 1 << 14
        for at in range(0, n, chunk):
            pos = torch.arange(at, min(at + chunk, n), dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]                 # [P, R/2]
            c, s = (freqs.cos() * self.attention_factor).to(**like), (freqs.sin() * self.attention_factor).to(**like)
            for start in (0, half):                                       # x 1.0 (all but yarn) is exact
                cos[at:at + len(pos), start:start + pairs] = c
                sin[at:at + len(pos), start:start + pairs] = s
        self._cos, self._sin = cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The [T, 1, D] cos and sin rows of `positions`, in `dtype` (once per step, shared by all layers).

        `positions` [T], or [3, T] for M-RoPE: each column takes the row of its section's component (a token whose
        three components are equal gets the plain row of that position)."""
        if positions.dim() == 2:
            return self._mrope_rows(self.cos, positions, dtype), self._mrope_rows(self.sin, positions, dtype)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def _mrope_rows(self, table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.mrope_sections is None:
            raise ValueError("3-D rotary positions given to a model without M-RoPE (mrope_section)")
        rows = table[positions]                                                   # [3, T, D]
        sections = self.mrope_sections.to(rows.device)[None, None, :].expand(1, *rows.shape[1:])
        return rows.gather(0, sections)[0].to(dtype).unsqueeze(1)                 # [T, 1, D]


def fit_rotary(model: nn.Module, positions: int) -> None:
    """Build every rotary table of `model` for `positions` positions (what its KV cache can hold)."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.fit(positions)
