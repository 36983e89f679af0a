"""What a prompt with images brings besides its token ids (Qwen2-VL and Qwen2.5-VL): the embeddings that replace its
image tokens' rows, the 3-D rotary positions (M-RoPE) of its tokens, and a key naming its images.

Made once when the request starts (engine/image_tower.py, on rank 0), then carried as it is by the scheduler's plans to
every rank's runner, which places the embeddings and positions into the steps that compute those prompt tokens
(step/inputs.py). Generated tokens are text: all three components of their position are the same, `rope_delta`
after their index (as transformers' `rope_deltas`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class PromptImages:
    rope_positions: Any      # [3, P] long tensor: (temporal, height, width) position of each prompt token
    rope_delta: int          # a token at index i >= P turns with position i + rope_delta in every section
    embed_positions: Any     # [E] long tensor: the prompt indices of the image tokens, increasing
    embeds: Any              # [E, hidden] tensor: their embeddings (the vision encoder's output, in order)
    key: str                 # the images' identity (a hash of their pixels and grids): part of prefix-cache keys

    def position(self, index: int) -> int:
        """The rotary position of a token past the prompt (or of a prompt token whose components are equal)."""
        return index + self.rope_delta
