"""PEFT LoRA folders: `adapter_config.json` + `adapter_model.safetensors` (or `adapter_model.bin`) read into a
LoraAdapter (lora/shard.py) for one model.

Tensor names (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`) lose PEFT's prefix and become the
decoder's module names. Each module's r and lora_alpha are the config's, or its `rank_pattern` / `alpha_pattern`
entry matched as PEFT matches them; the scale is lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`.

Refused, naming the key, tensor or module: what would make the adapter compute more than x @ A.T @ B.T * scale on
the seven projections (biases, DoRA and the other variants, saved or trained modules beside the adapter, LoRA on
parameters), initializations that changed the base model's weights (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA: PEFT
converts such adapters to plain ones with `path_initial_model_for_weight_conversion`), config keys this reader does
not know set to anything but an empty value, and tensors that do not fit the model.
"""
from __future__ import annotations

import json
import math
import os
import re

import torch

from allspark_server.lora.shard import LoraAdapter, LoraAdapterError, base_shape, check_module, check_pair
from allspark_server.models.args import ModelArgs

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")     # PEFT's order of preference
PREFIX = "base_model.model."
TENSOR = re.compile(r"(.+)\.lora_([AB])\.weight")
# config keys that change what the adapter computes, refused when set (true or not empty)
REFUSED_KEYS = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "lora_bias": "biases on lora_B are not supported",
    "modules_to_save": "modules trained and saved beside the adapter are not supported",
    "trainable_token_indices": "trained embedding rows are not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "replicated layers are not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "velora_config": "the VeLoRA variant is not supported",
    "monteclora_config": "the MonteCLoRA variant is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "the KaSA variant is not supported",
}
# config keys that leave a plain LoRA's forward pass alone (training, initialization, bookkeeping); the loaders'
# own (r, lora_alpha, ...) are read below
INERT_KEYS = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
              "exclude_modules", "lora_dropout", "fan_in_fan_out", "layers_pattern", "megatron_config",
              "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
              "runtime_config", "ensure_weight_tying"}
READ_KEYS = {"peft_type", "r", "lora_alpha", "use_rslora", "bias", "init_lora_weights", "target_modules",
             "layers_to_transform", "rank_pattern", "alpha_pattern"}
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")   # init_lora_weights (prefixes)


def read_config(path: str) -> tuple[dict, str]:
    """(adapter_config.json, its path) of the folder `path`."""
    if not os.path.isdir(path):
        raise LoraAdapterError(f"{path!r} is not a folder (a PEFT adapter folder or an .aslora file is wanted)")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoraAdapterError(f"{path!r} has no {CONFIG_FILE} (is it a PEFT LoRA adapter folder?)")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{file!r} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{file!r} holds a {type(cfg).__name__}, not a JSON object")
    return cfg, file


def _positive(key: str, value, where: str, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise LoraAdapterError(f"{where}: {key} {value!r} is not a positive {'integer' if integer else 'number'}")


def check_config(cfg: dict, args: ModelArgs, where: str) -> None:
    """Refuse what a plain LoRA on the seven projections of this model cannot be, naming the key."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {cfg['peft_type']!r} is not a LoRA adapter (peft_type 'LORA')")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise LoraAdapterError(f"{where}: the key {key!r} is missing")
        _positive(key, cfg[key], where, key == "r")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias {cfg['bias']!r}: adapters that train biases are not supported "
                               f"(bias 'none')")
    for key, why in REFUSED_KEYS.items():
        if cfg.get(key):
            raise LoraAdapterError(f"{where}: {key} {cfg[key]!r}: {why}")
    unknown = sorted(k for k, v in cfg.items() if k not in READ_KEYS | INERT_KEYS | set(REFUSED_KEYS)
                     and v not in (None, False, "", [], {}))
    if unknown:
        raise LoraAdapterError(f"{where}: keys this reader does not know, which may change what the adapter "
                               f"computes: {', '.join(f'{k} {cfg[k]!r}' for k in unknown)}")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS + ("mica",)):
        why = ("a LoRA variant that is not supported" if init.lower() == "mica" else
               "it changed the base model's weights when the adapter was made; convert the adapter to a plain LoRA "
               "(PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))")
        raise LoraAdapterError(f"{where}: init_lora_weights {init!r}: {why}")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise LoraAdapterError(f"{where}: use_rslora {cfg['use_rslora']!r} is not true or false")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):       # a str is a regular expression (or "all-linear"): tensors decide
        allowed = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for t in targets:
            if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in allowed:
                raise LoraAdapterError(f"{where}: target_modules names {t!r}, which cannot take a LoRA here; "
                                       f"supported: {', '.join(allowed)}")
    layers = cfg.get("layers_to_transform")
    for i in [layers] if isinstance(layers, int) else (layers or []):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < args.num_layers:
            raise LoraAdapterError(f"{where}: layers_to_transform names layer {i!r}, but the model has "
                                   f"{args.num_layers} layers (0..{args.num_layers - 1})")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict):
            raise LoraAdapterError(f"{where}: {key} is a {type(patterns).__name__}, not an object")
        for pattern, value in patterns.items():
            _positive(f"{key}[{pattern!r}]", value, where, key == "rank_pattern")
            try:
                re.compile(pattern)
            except re.error as e:
                raise LoraAdapterError(f"{where}: {key} key {pattern!r} is not a regular expression: {e}") from None


def pattern_value(patterns: dict, module: str, default):
    """A module's value in a rank_pattern / alpha_pattern: the first key that matches the end of its name at a
    dot (PEFT's get_pattern_key), else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_weights(path: str) -> tuple[dict, str]:
    """(name -> tensor, the file) of the folder's adapter weights."""
    file = next((os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if file is None:
        raise LoraAdapterError(f"{path!r} has neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file
            tensors = load_file(file)
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:      # any reader's failure on a damaged file
        raise LoraAdapterError(f"{file!r} cannot be read: {e}") from None
    if not isinstance(tensors, dict):
        raise LoraAdapterError(f"{file!r} holds a {type(tensors).__name__}, not a state dict")
    return tensors, file


def _layer_order(module: str):
    head, _, tail = module.partition("model.layers.")
    index, _, rest = tail.partition(".")
    return (head, int(index), rest) if index.isdigit() else (module, -1, "")


def read_peft_folder(path: str, args: ModelArgs, name: str) -> LoraAdapter:
    """The adapter in the PEFT folder `path`, checked against `args` (the caller checks the architecture)."""
    cfg, config_file = read_config(path)
    check_config(cfg, args, config_file)
    tensors, file = read_weights(path)
    pairs: dict[str, dict[str, tuple[str, object]]] = {}
    for key, t in tensors.items():
        m = TENSOR.fullmatch(key.removeprefix(PREFIX))
        if m is None:
            raise LoraAdapterError(f"{file}: tensor {key!r} is not the lora_A / lora_B weight of a linear module "
                                   f"(DoRA magnitudes, LoRA biases, embedding adapters and saved modules are not "
                                   f"supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = (key, t)
    if not pairs:
        raise LoraAdapterError(f"{file}: holds no LoRA tensors")
    base, modules = base_shape(args), {}
    for module in sorted(pairs, key=_layer_order):
        part, found = check_module(module, args, file), pairs[module]
        for have, lack in (("A", "B"), ("B", "A")):
            if lack not in found:
                raise LoraAdapterError(f"{file}: module {module!r} has {found[have][0]!r} but no lora_{lack} "
                                       f"weight")
        r = pattern_value(cfg.get("rank_pattern") or {}, module, cfg["r"])
        alpha = pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        (key_a, a), (key_b, b) = found["A"], found["B"]
        a, b = check_pair(part, a, b, (key_a, key_b), base, file, r)
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[module] = (a, b, float(scale))
    return LoraAdapter(name, max(a.shape[0] for a, _, _ in modules.values()), modules, base)
