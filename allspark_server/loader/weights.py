"""Checkpoint tensor names <-> model parameters: merged projections (MergedColumnParallelLinear)
are stored in checkpoints as their separate parts and concatenated here, per rank, at load time."""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.layers.linear import MergedColumnParallelLinear


def _merged_modules(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, MergedColumnParallelLinear):
            yield name, module, name.rsplit(".", 1)[0]


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a (meta-device) model needs, with their shapes."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, module, parent in _merged_modules(model):
        for suffix in ("weight", "bias"):
            merged = shapes.pop(f"{name}.{suffix}", None)
            if merged is None:
                continue
            for part, size in module.parts:
                shapes[f"{parent}.{part}.{suffix}"] = (size,) + merged[1:]
    return shapes


def to_model_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename/concatenate checkpoint tensors (this rank's slices) into the model's state dict."""
    state = dict(tensors)
    for name, module, parent in _merged_modules(model):
        for suffix in ("weight", "bias"):
            keys = [f"{parent}.{part}.{suffix}" for part, _ in module.parts]
            if keys[0] in state:
                state[f"{name}.{suffix}"] = torch.cat([state.pop(k) for k in keys], dim=0)
    return state
