"""Qwen2-VL / Qwen2.5-VL's vision transformer: pixel_values (the processor's flattened patches) and
image_grid_thw in, one embedding per image token of the prompt out (the language model's width).

    encoder = VisionEncoder.from_hf(folder)                 # or (config dict, state dict), dtype, device
    embeds = encoder(pixel_values, image_grid_thw)          # [sum of tokens_per_image, out_dim]
    per_image = encoder.split(embeds, image_grid_thw)       # one [tokens, out_dim] tensor an image
    per_request = encoder.encode_batch([(pv1, grid1), (pv2, grid2)])   # several requests in one forward

Steps: patch embedding (a Linear over each flattened patch), the blocks with 2-D rotary attention inside each
frame (Qwen2.5-VL: inside windows, except the fullatt_block_indexes blocks, with the patches reordered window by
window for the whole tower), the merger (merge x merge patches -> one token), and the tokens back in the
processor's order. Images never attend to each other, so an image's embeddings do not depend on its batch."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from allspark_server.vision.blocks import Block, PatchMerger, rotary_tables
from allspark_server.vision.checkpoint import vision_state
from allspark_server.vision.geometry import check_grid, frame_bounds, patch_positions, tokens_per_image, window_order
from allspark_server.vision.tower_config import VisionConfig


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.dim, bias=False, dtype=dtype, device=device)
        self.patch_embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(cfg, dtype, device) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype, device)

    @classmethod
    def from_hf(cls, config: dict | str, weights: str | Mapping[str, torch.Tensor] | None = None,
                dtype: torch.dtype | str = torch.float32, device=None) -> "VisionEncoder":
        """From config.json's dict or the model folder, and the weights: a folder (default: the config's
        folder) or a state dict (`model.visual.*`, `visual.*` or bare names). `dtype`: a torch dtype or its name
        ("float32", "bfloat16", ...)."""
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r} for the vision encoder")
            dtype = getattr(torch, dtype)
        if weights is None:
            if not isinstance(config, str):
                raise ValueError("VisionEncoder.from_hf: give the weights (a folder or a state dict) with a config "
                                 "dict")
            weights = config
        cfg = VisionConfig.from_hf(config)
        with torch.device("meta"):
            encoder = cls(cfg, dtype)
        encoder.load(vision_state(weights), device)
        return encoder.eval()

    def load(self, state: dict[str, torch.Tensor], device=None) -> None:
        """Take every parameter from `state` (names as vision_state gives them), cast to this encoder's dtype."""
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(state))
        unknown = sorted(set(state) - set(own))
        if missing or unknown:
            raise ValueError(f"vision checkpoint does not fit the config: missing {missing[:8]}, "
                             f"unexpected {unknown[:8]}")
        for name, param in own.items():
            tensor = state[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"vision tensor {name}: shape {tuple(tensor.shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} from the config")
            module, _, leaf = name.rpartition(".")
            value = tensor.to(device=device if device is not None else tensor.device, dtype=param.dtype)
            setattr(self.get_submodule(module), leaf, nn.Parameter(value.contiguous(), requires_grad=False))

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    def tokens_per_image(self, image_grid_thw) -> list[int]:
        return tokens_per_image(image_grid_thw, self.cfg.spatial_merge_size)

    def split(self, embeds: torch.Tensor, image_grid_thw) -> list[torch.Tensor]:
        """The forward's output cut into one tensor an image."""
        return list(torch.split(embeds, self.tokens_per_image(image_grid_thw)))

    def encode_batch(self, requests: Sequence[tuple]) -> list[list[torch.Tensor]]:
        """Several requests' (pixel_values, image_grid_thw) in one forward: each request's list of per-image
        embeddings (equal to encoding each request alone: images never attend to each other)."""
        if not requests:
            return []
        pixels = torch.cat([torch.as_tensor(p) for p, _ in requests])
        grids = [torch.as_tensor(g, dtype=torch.long).reshape(-1, 3) for _, g in requests]
        images = self.split(self(pixels, torch.cat(grids)), torch.cat(grids))
        out, at = [], 0
        for g in grids:
            out.append(images[at:at + len(g)])
            at += len(g)
        return out

    @torch.no_grad()
    def forward(self, pixel_values, image_grid_thw) -> torch.Tensor:
        """pixel_values [N patches, C*T*P*P] (tensor or numpy), image_grid_thw [n images, 3] ->
        [N / merge^2, out_dim] in the order of the image tokens."""
        cfg = self.cfg
        pixel_values = torch.as_tensor(pixel_values)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must be [patches, {cfg.patch_dim}] (channels x temporal patch x patch x "
                             f"patch), got {list(pixel_values.shape)}")
        check_grid(image_grid_thw, cfg.spatial_merge_size, pixel_values.shape[0])
        x = self.patch_embed(pixel_values.to(device=self.device, dtype=self.dtype))
        positions = patch_positions(image_grid_thw, cfg.spatial_merge_size).to(self.device)
        frames = frame_bounds(image_grid_thw)
        order = windows = None
        if cfg.window_size:
            order, windows = window_order(image_grid_thw, cfg.spatial_merge_size,
                                          cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)
            order = order.to(self.device)
            x = self._by_unit(x, order)
            positions = self._by_unit(positions, order)
        rope = rotary_tables(positions, cfg.head_dim, cfg.rope_theta)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, windows if cfg.is_windowed(i) else frames)
        out = self.merger(x)
        if order is not None:
            out = out[torch.argsort(order)]
        return out

    def _by_unit(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """x's rows regrouped merge unit by merge unit in `order`."""
        unit = self.cfg.merge_unit
        return x.view(-1, unit, *x.shape[1:])[order].reshape(x.shape)
