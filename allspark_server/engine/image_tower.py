"""Images of a request's prompt turned into what the decoder needs (core/multimodal.py's PromptImages), on rank 0
when the request starts: the vision tower's embeddings of each image (vision/encoder.py, kept by image hash so a
chat that sends the same image again does not encode it again), the prompt's M-RoPE positions (vision/mrope.py)
and where the image tokens are. The tower is built on first use from the tensors stored beside the decoder's
(models/qwen2_vl.py); it runs in the callers' threads, the images of requests that start together in shared
forwards (image_batcher.py).
"""
from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import torch

from allspark_client.validation import ConfigError
from allspark_server.core.multimodal import PromptImages
from allspark_server.engine.image_batcher import ImageBatcher
from allspark_server.models.qwen2_vl import VISION_PREFIX
from allspark_server.vision.encoder import VisionEncoder
from allspark_server.vision.image_files import image_hashes
from allspark_server.vision.mrope import rope_index


class ImageTower:
    """A served vision-language model's encoder, its config and its cache of image embeddings."""

    def __init__(self, model_file, device_kind):
        self.config = json.loads(model_file.graph.hf_config_json)
        self.image_token_id = int(self.config["image_token_id"])
        tensors = model_file.side_tensors(VISION_PREFIX)
        if not tensors:
            raise ConfigError(f"the model file has no vision tower ({VISION_PREFIX}* tensors): serialize the "
                              "model folder again with this allspark")
        self.encoder = VisionEncoder.from_hf(self.config, tensors, model_file.dtype, device_kind.device)
        # concurrent requests' images in shared forwards, cached; a GPU runs many images in one short forward
        self.batcher = ImageBatcher(self.encoder, max_patches=device_kind.vision_forward_patches)

    def prompt_images(self, ids: list[int], pixels: np.ndarray, grid: np.ndarray) -> PromptImages:
        """PromptImages of a prompt whose image tokens stand for the images of `pixels` / `grid`; ConfigError
        (PARAM_ERROR) naming what does not fit."""
        cfg = self.encoder.cfg
        if pixels.shape[1] != cfg.patch_dim:
            raise ConfigError(f"pixel_values rows have {pixels.shape[1]} values, this model's patches "
                              f"{cfg.patch_dim} (channels x temporal patch x patch x patch)")
        merge = cfg.spatial_merge_size
        if (grid[:, 1:] % merge).any():
            raise ConfigError(f"image_grid_thw heights and widths must be multiples of {merge}, got {grid.tolist()}")
        tokens = [int(t * h * w) // (merge * merge) for t, h, w in grid.tolist()]
        ids_t = torch.tensor(ids, dtype=torch.long)
        at = torch.nonzero(ids_t == self.image_token_id).flatten()
        if len(at) != sum(tokens):
            raise ConfigError(f"the prompt has {len(at)} image tokens (id {self.image_token_id}) but its "
                              f"{len(tokens)} image(s) make {sum(tokens)}: give input_ids as the model's processor "
                              "expands them")
        keys, items, offset = image_hashes(pixels, grid), [], 0
        for (t, h, w), key in zip(grid.tolist(), keys):
            items.append((key, pixels[offset:offset + t * h * w], [t, h, w]))
            offset += t * h * w
        try:
            embeds = self.batcher.embed(items)
        except ValueError as e:                # what the encoder checks: named for the caller
            raise ConfigError(f"image: {e}") from None
        try:
            positions, delta = rope_index(ids, grid, self.config)
        except ValueError as e:
            raise ConfigError(f"image tokens: {e}") from None
        return PromptImages(torch.as_tensor(positions, dtype=torch.long), int(delta), at,
                            torch.cat(embeds).to("cpu"), hashlib.sha256("|".join(keys).encode()).hexdigest())


_towers_lock = threading.Lock()


def tower_of(model) -> ImageTower:
    """The served model's ImageTower, built by its first request with images; ConfigError for a text-only model."""
    tower = getattr(model, "_image_tower", None)
    if tower is not None:
        return tower
    if not model.runner.args.mrope_section:
        raise ConfigError(f"{model.runner.args.architecture} takes no images (pixel_values / image_grid_thw)")
    with _towers_lock:
        if getattr(model, "_image_tower", None) is None:
            model._image_tower = ImageTower(model.runner.model_file, model.runner.device_kind)
        return model._image_tower
