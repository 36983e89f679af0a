"""The LoRA package's door: `load_adapter` reads a PEFT folder (lora/peft_folder.py) or an .aslora file
(lora/aslora.py) for one model, `fused_rank_shard` gives a tensor-parallel rank its shard of one fused projection
(lora/shard.py), and DashInfer's `lora_cfg` (HuggingFaceModel.serialize's argument) is checked and carried out by
`LoraCfg`.

Adapters are refused here, naming the problem (LoraAdapterError), for the reasons those modules list; the engine's
rank limit (lora_max_rank) is the engine's to check, against the adapter's `rank`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from allspark_server.lora.aslora import read_aslora, save_aslora
from allspark_server.lora.peft_folder import read_peft_folder
from allspark_server.lora.shard import PROJECTIONS, LoraAdapter, LoraAdapterError, check_architecture, fused_rank_shard
from allspark_server.models.args import ModelArgs

__all__ = ["PROJECTIONS", "LoraAdapter", "LoraAdapterError", "LoraCfg", "fused_rank_shard", "load_adapter",
           "read_lora_cfg", "save_aslora", "write_adapters"]

ASLORA_SUFFIX = ".aslora"
LORA_CFG_KEYS = ("input_base_dir", "lora_names", "lora_only")


def load_adapter(path: str, args: ModelArgs, name: str | None = None) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder, or an .aslora file) for the model of `args`; `name` defaults to the
    folder's name or the file's stem."""
    if not isinstance(path, (str, os.PathLike)):
        raise LoraAdapterError(f"an adapter's path must be a str, got {type(path).__name__}")
    path = os.fspath(path)
    if name is not None and (not isinstance(name, str) or not name):
        raise LoraAdapterError(f"an adapter's name must be a non-empty str, got {name!r}")
    check_architecture(args)
    stem = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path):
        return read_peft_folder(path, args, name or stem)
    if os.path.isfile(path):
        return read_aslora(path, args, name or stem.removesuffix(ASLORA_SUFFIX))
    raise LoraAdapterError(f"{path!r} does not exist (a PEFT adapter folder or an .aslora file is wanted)")


@dataclass(frozen=True)
class LoraCfg:
    """DashInfer's serialize(lora_cfg=...): each adapter of `lora_names` is read from the PEFT folder
    `<input_base_dir>/<name>/` and written as `<output dir>/<name>.aslora`; with `lora_only` the model's own files
    are not written."""
    input_base_dir: str
    lora_names: tuple[str, ...]
    lora_only: bool = False

    @classmethod
    def from_dict(cls, cfg) -> "LoraCfg":
        if not isinstance(cfg, Mapping):
            raise LoraAdapterError(f"expected a dict ({', '.join(LORA_CFG_KEYS)}), got {type(cfg).__name__}")
        unknown = sorted(str(k) for k in cfg if k not in LORA_CFG_KEYS)
        if unknown:
            raise LoraAdapterError(f"unknown keys {', '.join(map(repr, unknown))} (known: {', '.join(LORA_CFG_KEYS)})")
        for key in ("input_base_dir", "lora_names"):
            if key not in cfg:
                raise LoraAdapterError(f"the key {key!r} is missing")
        base = cfg["input_base_dir"]
        if not isinstance(base, (str, os.PathLike)) or not os.path.isdir(base):
            raise LoraAdapterError(f"input_base_dir {base!r} is not a folder (it holds a PEFT folder per adapter)")
        names = cfg["lora_names"]
        if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names:
            raise LoraAdapterError(f"lora_names must be a non-empty list of adapter names, got {names!r}")
        for n in names:
            if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or os.sep in n:
                raise LoraAdapterError(f"lora_names: {n!r} is not an adapter's folder name")
        if len(set(names)) != len(names):
            raise LoraAdapterError(f"lora_names names an adapter twice: {list(names)}")
        lora_only = cfg.get("lora_only", False)
        if not isinstance(lora_only, bool):
            raise LoraAdapterError(f"lora_only {lora_only!r} is not true or false")
        return cls(os.fspath(base), tuple(names), lora_only)

    def load(self, args: ModelArgs) -> list[LoraAdapter]:
        """Every adapter, read and checked against the model (before anything is written)."""
        return [load_adapter(os.path.join(self.input_base_dir, n), args, n) for n in self.lora_names]


def read_lora_cfg(lora_cfg, args: ModelArgs) -> tuple[list[LoraAdapter], bool]:
    """(every adapter a serialize lora_cfg names, read and checked against the model; its lora_only), or ([], False)
    for no lora_cfg (None)."""
    if lora_cfg is None:
        return [], False
    cfg = LoraCfg.from_dict(lora_cfg)
    return cfg.load(args), cfg.lora_only


def write_adapters(adapters: list[LoraAdapter], output_dir: str) -> list[str]:
    """`<output_dir>/<name>.aslora` for each adapter; their paths."""
    paths = [os.path.join(output_dir, a.name + ASLORA_SUFFIX) for a in adapters]
    for adapter, path in zip(adapters, paths):
        save_aslora(adapter, path)
    return paths
