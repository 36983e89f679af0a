"""What every remote-layout writer of tests/remote_layouts.py and tests/baichuan_layout.py shares: reading a
save_pretrained folder (its config, its tensors however stored, dtype, rope settings, head) and writing the remote
folder (config.json with overrides, model.safetensors, the tokenizer files and generation_config.json copied)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

_TOKENIZER_FIXED = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


def read_config(src: str) -> dict:
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def read_state(src: str) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained folder: model.safetensors, a sharded index, or pytorch_model.bin."""
    single = os.path.join(src, "model.safetensors")
    if os.path.exists(single):
        return load_file(single)
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(src, shard)))
        return state
    binary = os.path.join(src, "pytorch_model.bin")
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {src}")


def dtype_name(cfg: dict, state: dict[str, torch.Tensor]) -> str:
    name = cfg.get("dtype") or cfg.get("torch_dtype")          # transformers 5 writes "dtype", 4.x "torch_dtype"
    if isinstance(name, str):
        return name.replace("torch.", "")
    return str(next(iter(state.values())).dtype).replace("torch.", "")


def rope_params(cfg: dict) -> tuple[float, Optional[float], str]:
    """(rope_theta, partial_rotary_factor or None, rope_type) from a 4.x (flat) or 5.x (rope_parameters) config."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(theta), (None if factor is None else float(factor)), rope_type


def source_head(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The source's lm_head; a tied model saved without one gets a copy of its embedding (the real remote-code
    checkpoints all store an untied head)."""
    if "lm_head.weight" in state:
        return state["lm_head.weight"]
    return state["model.embed_tokens.weight"].clone()


def num_layers(cfg: dict) -> int:
    return int(cfg["num_hidden_layers"])


def require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"source checkpoint cannot be written in this layout: {what}")


def finish_folder(src: str, out_dir: str, config: dict, tensors: dict[str, torch.Tensor],
            config_overrides: Optional[dict]) -> str:
    if os.path.abspath(src) == os.path.abspath(out_dir):
        raise ValueError("out_dir must differ from the source folder")
    os.makedirs(out_dir, exist_ok=True)
    for key, value in (config_overrides or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    # safetensors refuses tensors that share storage (a tied head, a view): every tensor gets its own copy.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in sorted(os.listdir(src)):
        if (name.startswith("tokenizer") or name.startswith("chat_template") or name in _TOKENIZER_FIXED
                or name == "generation_config.json"):
            path = os.path.join(src, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(out_dir, name))
    return out_dir
