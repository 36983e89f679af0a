"""Read a local HuggingFace model folder: config.json, generation_config.json and weight tensors.

Weights come from `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
or `pytorch_model.bin` (sharded with `pytorch_model.bin.index.json`). Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Optional

import torch

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


class CheckpointError(ValueError):
    pass


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{model_dir!r} has no config.json (is it a HuggingFace model folder?)")
    return read_json(path)


def read_generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    return read_json(path) if os.path.isfile(path) else {}


def weight_files(model_dir: str) -> tuple[str, list[str]]:
    """('safetensors' | 'bin', [files]) for the folder's weights."""
    for index_name, kind in ((SAFE_INDEX, "safetensors"), (BIN_INDEX, "bin")):
        index = os.path.join(model_dir, index_name)
        if os.path.isfile(index):
            files = sorted(set(read_json(index)["weight_map"].values()))
            return kind, [os.path.join(model_dir, f) for f in files]
    for single, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        path = os.path.join(model_dir, single)
        if os.path.isfile(path):
            return kind, [path]
    raise CheckpointError(f"{model_dir!r} has no weights (model.safetensors, {SAFE_INDEX}, "
                          f"pytorch_model.bin or {BIN_INDEX})")


def iter_hf_tensors(model_dir: str, keep: Optional[Callable[[str], bool]] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the folder's checkpoint; with `keep`, safetensors files read only the
    tensors it keeps (a .bin file is read whole either way, and its tensors are yielded unfiltered)."""
    kind, files = weight_files(model_dir)
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"weight file {path!r} listed in the index is missing")
        if kind == "safetensors":
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
