"""Checkpoint tensor names <-> model parameters: merged projections (MergedColumnParallelLinear)
are stored in checkpoints as their separate parts, which each rank places one after the other at load
time (`merged_parts`; loader/rank_weights.py). Quantized weights (`<name>.qweight/.scales/.zeros`, or
`.mins` for uint4_min) are merged the same way; `quantize_layers` turns the model's linear layers into quantized
ones before their shards are read. `non_finite` says why a tensor cannot be a weight (NaN / inf values): every
loader checks each tensor it reads with it."""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.layers.linear import MergedColumnParallelLinear, ParallelLinear, RowParallelLinear
from allspark_server.quant.formats import check_shape
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

TENSOR_SUFFIXES = ("weight", "bias", "qweight", "scales", "zeros", "mins")


def non_finite(t: torch.Tensor) -> str | None:
    """None when every value of `t` is finite (integer tensors always are); else how many are NaN / inf and where
    the first one is. One weight of NaN makes every logit NaN, and greedy decoding then emits token 0 forever.
    The check is a sum, through which NaN and inf propagate: on a CPU it costs a tenth of a copy of the tensor, an
    isfinite pass 3-20 times more; only a sum that is not finite (or overflowed) is followed by the exact pass."""
    if t.is_floating_point() and t.element_size() == 1:   # fp8: no sum or isfinite of its own
        t = t.float()
    if not t.is_floating_point() or t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return None
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    if not count:                                       # finite values whose sum overflowed
        return None
    first = int(bad.reshape(-1).nonzero()[0])
    where = [int(i) for i in torch.unravel_index(torch.tensor(first), tuple(t.shape))]
    return (f"{count} of its {t.numel()} values {'is' if count == 1 else 'are'} not finite (NaN or inf; the first, "
            f"at {where}, is {t.reshape(-1)[first].item()})")


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


def merged_parts(model: nn.Module):
    """Each tensor a merged projection may have (`<module>.<suffix>`) with the checkpoint tensors it is made of,
    in their order along dim 0 (the loader merges those that the file stores)."""
    for name, module, parent in _merged_modules(model):
        for suffix in TENSOR_SUFFIXES:
            yield f"{name}.{suffix}", [f"{parent}.{part}.{suffix}" for part, _ in module.parts]


def checkpoint_weight_names(model: nn.Module) -> dict[str, list[str]]:
    """Each linear layer's module name -> the checkpoint weight names it is made of (merged: its parts)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedColumnParallelLinear):
            parent = name.rsplit(".", 1)[0]
            out[name] = [f"{parent}.{part}.weight" for part, _ in module.parts]
        elif isinstance(module, ParallelLinear):
            out[name] = [f"{name}.weight"]
    return out


def quantize_layers(model: nn.Module, scheme: QuantScheme, world_size: int = 1) -> None:
    """Make every linear layer whose checkpoint weights the scheme quantized a quantized layer of this
    rank's shape. Raises QuantConfigError where a fused projection's parts disagree, or where this
    rank's share of a row-parallel weight's input features would split a group or a 4-bit block."""
    for name, parts in checkpoint_weight_names(model).items():
        groups = {scheme.groups[p] for p in parts if p in scheme.groups}
        if not groups:
            continue
        formats = {scheme.format_for(p) for p in parts}
        if len(groups) > 1 or len(formats) > 1 or any(p not in scheme.groups for p in parts):
            raise QuantConfigError(
                f"{', '.join(parts)} are fused into one projection ({name}) and need one group size and one "
                f"format; the scheme gives them {[scheme.groups.get(p, 'not quantized') for p in parts]}, "
                f"formats {[scheme.format_for(p) for p in parts]}")
        module = model.get_submodule(name)
        group, fmt = groups.pop(), formats.pop()
        if isinstance(module, RowParallelLinear) and world_size > 1:
            try:
                check_shape(fmt, group, module.in_features, name)
            except ValueError as e:
                raise QuantConfigError(
                    f"{e}: on {world_size} ranks this rank holds {module.in_features} of {name}'s input "
                    f"features, so its quantization groups would straddle the split (choose a group size that "
                    f"divides {module.in_features})") from None
        module.quantize_(fmt, group, scheme.act_bits)
