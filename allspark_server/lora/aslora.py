"""`.aslora` files: a LoraAdapter (lora/shard.py) as safetensors, loadable on its own later (DashInfer's
serialize writes one per adapter its lora_cfg names, lora/adapter.py).

Tensors `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r], float32, under the decoder's module names
(`model.layers.3.self_attn.q_proj`). Metadata (safetensors' strings): `format` "allspark-lora", `version` "1",
`name`, `rank`, `scales` (JSON: module -> scale) and `base` (JSON: the base model's shape it was made for,
shard.base_shape). Reading checks every field, tensor and the base shape against the model it is loaded for.
"""
from __future__ import annotations

import json
import math
import os

from safetensors import safe_open
from safetensors.torch import save_file

from allspark_server.lora.shard import LoraAdapter, LoraAdapterError, base_shape, check_module, check_pair
from allspark_server.models.args import ModelArgs

FORMAT, VERSION = "allspark-lora", "1"
SUFFIXES = {".lora_A": "A", ".lora_B": "B"}


def save_aslora(adapter: LoraAdapter, path: str) -> None:
    """Write `adapter` to `path` (through a temporary file beside it, so a reader never sees half a file)."""
    tensors = {}
    for module, (a, b, _) in adapter.modules.items():
        tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"] = a.contiguous(), b.contiguous()
    metadata = {"format": FORMAT, "version": VERSION, "name": adapter.name, "rank": str(adapter.rank),
                "scales": json.dumps({m: s for m, (_, _, s) in adapter.modules.items()}),
                "base": json.dumps(adapter.base)}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    save_file(tensors, partial, metadata)
    os.replace(partial, path)


def _read(path: str) -> tuple[dict, dict]:
    if not os.path.isfile(path):
        raise LoraAdapterError(f"{path!r} does not exist (an .aslora file or a PEFT adapter folder is wanted)")
    try:
        with safe_open(path, "pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:      # any reader's failure on a damaged file
        raise LoraAdapterError(f"{path!r} cannot be read as safetensors: {e}") from None


def _metadata(path: str, meta: dict) -> tuple[int, dict, dict]:
    """(rank, scales, base) of the file's metadata."""
    if meta.get("format") != FORMAT:
        raise LoraAdapterError(f"{path!r} is not an .aslora file (its metadata's format is {meta.get('format')!r}, "
                               f"expected {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise LoraAdapterError(f"{path!r} is an .aslora file of version {meta.get('version')!r}; this allspark "
                               f"reads version {VERSION}: serialize the adapter again")
    try:
        rank, scales, base = int(meta["rank"]), json.loads(meta["scales"]), json.loads(meta["base"])
    except (KeyError, ValueError) as e:
        raise LoraAdapterError(f"{path!r}: its metadata's rank, scales or base is missing or unreadable ({e!r})"
                               ) from None
    if not isinstance(scales, dict) or not isinstance(base, dict):
        raise LoraAdapterError(f"{path!r}: its metadata's scales and base must be JSON objects")
    return rank, scales, base


def read_aslora(path: str, args: ModelArgs, name: str) -> LoraAdapter:
    """The adapter in the .aslora file `path`, checked against `args` (the caller checks the architecture)."""
    meta, tensors = _read(path)
    rank, scales, base = _metadata(path, meta)
    expected = base_shape(args)
    differ = [f"{k} {base.get(k)!r} (the model's: {v!r})" for k, v in expected.items() if base.get(k) != v]
    if differ:
        raise LoraAdapterError(f"{path!r} was made for another model: {', '.join(differ)}")
    pairs: dict[str, dict[str, tuple[str, object]]] = {}
    for key, t in tensors.items():
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoraAdapterError(f"{path!r}: tensor {key!r} is neither a <module>.lora_A nor a <module>.lora_B")
        pairs.setdefault(key[:-len(suffix)], {})[SUFFIXES[suffix]] = (key, t)
    if set(pairs) != set(scales):
        odd = sorted(set(pairs) ^ set(scales))
        raise LoraAdapterError(f"{path!r}: modules with tensors and modules with scales differ: {odd[:5]}")
    if not pairs:
        raise LoraAdapterError(f"{path!r} holds no LoRA tensors")
    modules = {}
    for module, found in pairs.items():
        part = check_module(module, args, path)
        if set(found) != {"A", "B"}:
            lack = ({"A", "B"} - set(found)).pop()
            raise LoraAdapterError(f"{path!r}: module {module!r} has no lora_{lack} tensor")
        scale = scales[module]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise LoraAdapterError(f"{path!r}: module {module!r}'s scale {scale!r} is not a finite number")
        a, b = check_pair(part, found["A"][1], found["B"][1], (found["A"][0], found["B"][0]), expected, path)
        modules[module] = (a, b, float(scale))
    largest = max(a.shape[0] for a, _, _ in modules.values())
    if largest != rank:
        raise LoraAdapterError(f"{path!r}: its metadata's rank {rank} is not its largest r ({largest})")
    return LoraAdapter(name, rank, modules, expected)
