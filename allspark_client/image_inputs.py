"""The image part of a request's inputs (vision-language models: Qwen2-VL, Qwen2.5-VL), checked before anything
starts: `pixel_values` (the processor's flattened patches, [patches, channels x temporal patch x patch x patch])
and `image_grid_thw` ([images, 3]: frames, patch rows, patch columns), under the names transformers' processors
give them, as numpy arrays, torch tensors or nested lists. Torch-free: shared by Engine and ClientEngine.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from allspark_client.channel import MAX_MESSAGE_BYTES
from allspark_client.validation import ConfigError, _check

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
MAX_IMAGES = 64                       # images in one prompt
MAX_PATCHES = 1 << 20                 # patches in one prompt (a 2B model's 12.8 M-pixel default cap is ~16k)


def _array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):                          # a torch tensor, without importing torch
        value = value.detach().cpu().float().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{name} must be an array: {e}") from None


def parse_image_inputs(inputs: dict) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(pixel_values float32 [N, D], image_grid_thw int64 [n, 3]) of a request's inputs, or None without images.
    Raises ConfigError (PARAM_ERROR) naming the key for anything else; the grid is checked against the pixels'
    rows here, against the model (patch size, image tokens in the prompt) where the model is known."""
    present = [k for k in IMAGE_KEYS if inputs.get(k) is not None]
    if not present:
        return None
    _check(len(present) == 2, f"inputs need both {' and '.join(IMAGE_KEYS)} (got only {present[0]})")
    pixels = _array(inputs["pixel_values"], "pixel_values")
    grid = _array(inputs["image_grid_thw"], "image_grid_thw")
    _check(pixels.ndim == 2 and pixels.shape[0] > 0 and pixels.shape[1] > 0,
           f"pixel_values must be a [patches, patch size] array, got shape {list(pixels.shape)}")
    _check(np.issubdtype(pixels.dtype, np.floating), f"pixel_values must be floats, got {pixels.dtype}")
    _check(bool(np.isfinite(pixels).all()), "pixel_values holds NaN or infinite values")
    _check(grid.ndim == 2 and grid.shape[1] == 3 and 1 <= grid.shape[0] <= MAX_IMAGES,
           f"image_grid_thw must be [images, 3] with 1..{MAX_IMAGES} images, got shape {list(grid.shape)}")
    _check(np.issubdtype(grid.dtype, np.integer), f"image_grid_thw must be integers, got {grid.dtype}")
    _check(bool((grid > 0).all()), f"image_grid_thw entries must be positive, got {grid.tolist()}")
    patches = int(np.prod(grid.astype(np.int64), axis=1).sum())
    _check(patches <= MAX_PATCHES, f"image_grid_thw asks for {patches} patches (at most {MAX_PATCHES})")
    _check(patches == pixels.shape[0], f"image_grid_thw covers {patches} patches but pixel_values has "
                                       f"{pixels.shape[0]} rows")
    return np.ascontiguousarray(pixels, dtype=np.float32), grid.astype(np.int64)


def request_images(pb, inputs: dict, limit_bytes: int = MAX_MESSAGE_BYTES):
    """A GenerateRequest's PromptImageInputs of the inputs (None without images); ConfigError when they are bad or
    the pixels would not fit one gRPC message."""
    images = parse_image_inputs(inputs)
    if images is None:
        return None
    pixels, grid = images
    _check(pixels.nbytes < limit_bytes - (1 << 20), f"pixel_values is {pixels.nbytes >> 20} MiB: a pool takes "
                                                    f"images of at most {(limit_bytes >> 20) - 1} MiB a request")
    return pb.PromptImageInputs(pixel_values=pixels.astype("<f4").tobytes(), patch_dim=pixels.shape[1],
                                image_grid_thw=grid.reshape(-1).tolist())


def images_from_proto(msg) -> dict:
    """The inputs' image keys of a PromptImageInputs (checked again by parse_image_inputs, where it is used)."""
    dim = max(1, msg.patch_dim)
    pixels = np.frombuffer(msg.pixel_values, dtype="<f4")
    _check(pixels.size % dim == 0, f"pixel_values of {pixels.size} values is not rows of patch_dim {dim}")
    grid = np.asarray(msg.image_grid_thw, dtype=np.int64)
    _check(grid.size % 3 == 0, f"image_grid_thw of {grid.size} values is not [images, 3]")
    return {"pixel_values": pixels.reshape(-1, dim), "image_grid_thw": grid.reshape(-1, 3)}
