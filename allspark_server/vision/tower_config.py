"""The vision tower's settings, read from a Qwen2-VL / Qwen2.5-VL config.json (its `vision_config`) into one
dataclass for both families. Qwen2-VL: LayerNorm blocks with a quick-GELU MLP of `embed_dim * mlp_ratio`, the
merger's output `hidden_size`. Qwen2.5-VL: RMSNorm blocks with a SwiGLU MLP of `intermediate_size`, window
attention (`window_size` pixels, full attention in `fullatt_block_indexes`), the merger's output `out_hidden_size`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

FAMILIES = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
            "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}
DEFAULT_TOKENS_PER_SECOND = 4   # Qwen2.5-VL's, where config.json has none (transformers' default)


@dataclass(frozen=True)
class VisionConfig:
    family: str                 # "qwen2_vl" | "qwen2_5_vl"
    depth: int
    dim: int                    # the blocks' width
    num_heads: int
    mlp_dim: int                # the MLP's hidden width
    hidden_act: str
    out_dim: int                # the merger's output: the language model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 0        # Qwen2.5-VL: a window's side in pixels (0: every block attends to the whole image)
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: int = 0  # Qwen2.5-VL video: temporal rotary positions per second
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The length of one flattened patch of pixel_values: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size ** 2

    def is_windowed(self, block: int) -> bool:
        return self.window_size > 0 and block not in self.fullatt_block_indexes

    @classmethod
    def from_hf(cls, config: dict | str) -> "VisionConfig":
        """From config.json's dict (or the model folder holding it)."""
        if isinstance(config, str):
            with open(os.path.join(config, "config.json") if os.path.isdir(config) else config,
                      encoding="utf-8") as f:
                config = json.load(f)
        family = family_of(config)
        v = config.get("vision_config")
        if not isinstance(v, dict):
            raise ValueError("config.json has no vision_config: not a vision-language model")
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        common = dict(family=family, depth=int(v["depth"]), num_heads=int(v["num_heads"]),
                      patch_size=int(v.get("patch_size", 14)),
                      temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                      in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                      spatial_merge_size=int(v.get("spatial_merge_size", 2)), rope_theta=theta)
        if family == "qwen2_vl":
            dim = int(v["embed_dim"])
            out = cls(dim=dim, mlp_dim=int(dim * v.get("mlp_ratio", 4)), hidden_act=v.get("hidden_act", "quick_gelu"),
                      out_dim=int(v["hidden_size"]), **common)
        else:
            out = cls(dim=int(v["hidden_size"]), mlp_dim=int(v["intermediate_size"]),
                      hidden_act=v.get("hidden_act", "silu"), out_dim=int(v["out_hidden_size"]),
                      window_size=int(v.get("window_size", 112)),
                      fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
                      tokens_per_second=int(v.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND)), **common)
        out.check()
        return out

    def check(self) -> None:
        if self.dim % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision width {self.dim} over {self.num_heads} heads must give a head size that is a "
                             f"multiple of 4 (its rotary turns with height and width)")
        if self.window_size and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"window_size {self.window_size} must be a multiple of patch_size x spatial_merge_size "
                             f"= {self.patch_size * self.spatial_merge_size}")


def family_of(config: dict) -> str:
    """"qwen2_vl" or "qwen2_5_vl" from config.json's architectures (or model_type)."""
    names = list(config.get("architectures") or []) + [config.get("model_type")]
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise ValueError(f"not a Qwen2-VL / Qwen2.5-VL config (architectures {config.get('architectures')}, "
                     f"model_type {config.get('model_type')!r})")
