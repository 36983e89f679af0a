"""The vision tower's tensors: read from a HF folder (only the `visual.*` ones, whichever file holds them) or taken
from a state dict, under the names VisionEncoder uses.

Checkpoints name them `model.visual.*` (transformers 5) or `visual.*` (older files, and allspark's model file);
a state dict of the tower alone has no prefix. Renamed on the way in: the patch embedding's Conv3d weight
`patch_embed.proj.weight` [dim, C, T, P, P] becomes the Linear weight `patch_embed.weight` [dim, C*T*P*P] (a
convolution whose stride is its kernel is a matrix product over flattened patches), and the merger's
`mlp.0` / `mlp.2` become `fc1` / `fc2`."""
from __future__ import annotations

from typing import Mapping

import torch

from allspark_server.loader.hf_reader import CheckpointError, iter_hf_tensors
from allspark_server.loader.weights import non_finite

PREFIXES = ("model.visual.", "visual.")
RENAMES = {"patch_embed.proj.weight": "patch_embed.weight", "merger.mlp.0.weight": "merger.fc1.weight",
           "merger.mlp.0.bias": "merger.fc1.bias", "merger.mlp.2.weight": "merger.fc2.weight",
           "merger.mlp.2.bias": "merger.fc2.bias"}


def strip_prefix(name: str, bare: bool) -> str | None:
    """The tower's own name of a checkpoint tensor (None: not the tower's). `bare`: names without a prefix are
    the tower's (a state dict of the tower alone)."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name if bare else None


def vision_state(source: str | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{VisionEncoder parameter name: tensor} from a model folder or a state dict (prefixed or bare)."""
    if isinstance(source, str):
        items, bare = iter_hf_tensors(source, lambda n: strip_prefix(n, False) is not None), False
    else:
        bare = not any(strip_prefix(n, False) is not None for n in source)
        items = source.items()
    out = {}
    for name, tensor in items:
        own = strip_prefix(name, bare)
        if own is None:
            continue
        bad = non_finite(tensor)
        if bad:
            raise CheckpointError(f"vision tensor {name}: {bad}")
        own = RENAMES.get(own, own)
        if own == "patch_embed.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        out[own] = tensor
    if not out:
        raise CheckpointError("no vision tower tensors (model.visual.* or visual.*) found: is this a Qwen2-VL / "
                              "Qwen2.5-VL checkpoint?")
    return out
