"""Serialize-time InstantQuant: validate the user's scheme against a model and replace its GEMM weights by
their quantized tensors, each with the tensor-parallel split mode the loader will slice it by.

A quantized weight `X.weight` becomes `X.qweight` / `X.scales` (/ `X.zeros`, or `X.mins` for uint4_min), all
[N, ...] like the weight, so they split like it: by output rows for column-parallel weights, by input columns
(codes and groups) for row-parallel ones; per-channel scales of a row-parallel weight hold whole rows and are
replicated.
"""
from __future__ import annotations

import torch

from allspark_server.layers.sharding import SplitMode, split_mode_for
from allspark_server.quant.formats import quantize
from allspark_server.quant.scheme import QuantScheme, plan_groups


def plan_scheme(user_config, shapes: dict[str, tuple[int, ...]], quantizable: str, meta_model) -> QuantScheme:
    """The user's customized_quant_config (None: int8 per channel) checked against this model's weights;
    QuantConfigError names the problem. `meta_model` (on the meta device) catches fused-projection conflicts."""
    from allspark_server.loader.weights import quantize_layers
    scheme = plan_groups(QuantScheme.from_user(user_config or {}), shapes, quantizable)
    quantize_layers(meta_model, scheme)
    return scheme


def quantize_tensors(tensors: dict[str, torch.Tensor], modes: dict[str, SplitMode], scheme: QuantScheme,
                     progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, SplitMode]]:
    """New (tensors, split modes) with every weight the scheme covers quantized."""
    tensors, modes = dict(tensors), dict(modes)
    names = [n for n in tensors if n in scheme.groups]
    for name in _progress(names, progress):
        group = scheme.groups[name]
        base = name[:-len(".weight")]
        mode = modes.pop(name)
        for part, t in quantize(tensors.pop(name), scheme.format_for(name), group).items():
            tensors[f"{base}.{part}"] = t
            modes[f"{base}.{part}"] = split_mode(part, mode, group)
    return tensors, modes


ROW_MODES = (SplitMode.ROW, SplitMode.ROW_HEADS)   # split along K: per-channel scales hold whole rows


def split_mode(part: str, weight_mode: SplitMode, group: int) -> SplitMode:
    """How a quantized tensor (`part`: qweight / scales / zeros / mins) of a weight split by `weight_mode`
    splits."""
    return SplitMode.REPLICATE if part != "qweight" and group == -1 and weight_mode in ROW_MODES else weight_mode


def quantized_split_modes(tensors: dict[str, torch.Tensor], rules, scheme: QuantScheme) -> dict[str, SplitMode]:
    """Split modes of the quantized tensors of checkpoints whose weights arrive quantized (GPTQ, GGUF): the
    split rules name weights as `<name>.weight`."""
    modes = {}
    for weight, group in scheme.groups.items():
        base, weight_mode = weight[:-len(".weight")], split_mode_for(weight, rules)
        for part in ("qweight", "scales", "zeros", "mins"):
            if f"{base}.{part}" in tensors:
                modes[f"{base}.{part}"] = split_mode(part, weight_mode, group)
    return modes


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="InstantQuant", unit="weight", disable=None)
