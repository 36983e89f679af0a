"""FP8 checkpoints as published: read a HF folder's `quantization_config` and keep each layer's float8_e4m3fn
weight as our fp8_e4m3 codes (quant/formats.py), its scales mapped without re-quantizing. Three layouts, for a
linear layer of K inputs and N outputs (weight float8_e4m3fn [N, K]; w = weight * scale):

  quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3's): weight_scale_inv fp32 [ceil(N / bn), ceil(K / bk)],
      one scale a block of weight_block_size [bn, bk] (despite the name, the multiplier)
  quant_method "compressed-tensors" (llm-compressor's FP8 / FP8-Dynamic, format float-quantized): one config group
      of 8-bit float weights, strategy "channel" (weight_scale [N, 1]) or "tensor" (weight_scale [1] or []);
      `ignore` names layers kept dense
  quant_method "fbgemm_fp8": weight_scale [N, 1]; modules_to_not_convert names layers kept dense

Per channel and per tensor map onto one fp32 scale per output row (group_size -1; a tensor's scale repeated).
Blocks map onto groups of bk along K: row n takes its block row's scales, scales[n, g] = weight_scale_inv[n // bn, g]
(bk must be one of our group sizes and divide K). An `input_scale` (static activation scales) is read and not
used: allspark serves fp8 weights weight-only, activations in the model's dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from allspark_server.quant.formats import GROUP_SIZES
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
TENSORS = ("weight", *WEIGHT_SCALES, "input_scale")


@dataclass(frozen=True)
class Fp8Config:
    method: str                              # quantization_config.quant_method, for messages
    group_size: int                          # -1: a scale per output row; else the block's K extent
    block_rows: int = 1                      # the block's N extent (weight_block_size[0]); 1 per channel / tensor
    not_converted: tuple[str, ...] = ()      # layers kept dense (ignore / modules_to_not_convert)
    bits: ClassVar[int] = 8
    tensors: ClassVar[tuple[str, ...]] = TENSORS   # a layer's checkpoint tensors (`<module>.<part>`)
    weight_format: ClassVar[str] = "fp8_e4m3"

    @classmethod
    def from_hf(cls, qc: dict) -> "Fp8Config":
        method = qc.get("quant_method")
        if method == "fp8":
            return cls._fine_grained(qc)
        if method == "compressed-tensors":
            return cls._compressed_tensors(qc)
        if method == "fbgemm_fp8":
            return cls("fbgemm_fp8", -1, 1, _names(qc, "modules_to_not_convert"))
        raise QuantConfigError(f"quantization_config.quant_method {method!r} is not an FP8 method (fp8, "
                               f"compressed-tensors, fbgemm_fp8)")

    @classmethod
    def _fine_grained(cls, qc: dict) -> "Fp8Config":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantConfigError(f"quantization_config.fmt {fmt!r} is not supported (e4m3)")
        not_converted = _names(qc, "modules_to_not_convert")
        block = qc.get("weight_block_size")
        if block is None:
            return cls("fp8", -1, 1, not_converted)
        return cls._blocks("fp8", block, "weight_block_size", not_converted)

    @classmethod
    def _blocks(cls, method: str, block, key: str, not_converted: tuple[str, ...]) -> "Fp8Config":
        """Scales a block of [rows, inputs] = `block` (quantization_config.`key`, for messages)."""
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantConfigError(f"quantization_config.{key} {block!r} is not two positive integers")
        if block[1] not in GROUP_SIZES:
            raise QuantConfigError(f"quantization_config.{key} {list(block)}: a block's {block[1]} "
                                   f"inputs are not one of allspark's group sizes {list(GROUP_SIZES[1:])}")
        return cls(method, block[1], block[0], not_converted)

    @classmethod
    def _compressed_tensors(cls, qc: dict) -> "Fp8Config":
        fmt = qc.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise QuantConfigError(f"quantization_config.format {fmt!r} is not supported (float-quantized, "
                                   f"naive-quantized: FP8 weights stored as they are)")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or len(groups) != 1:
            raise QuantConfigError(f"quantization_config.config_groups has {len(groups)} groups: allspark reads "
                                   f"one group of FP8 weights")
        (name, group), = groups.items()
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("symmetric", True))
        if kind != ("float", 8, True):
            raise QuantConfigError(f"quantization_config.config_groups.{name}.weights: type {kind[0]!r}, num_bits "
                                   f"{kind[1]!r}, symmetric {kind[2]!r} is not FP8 (float, 8, true)")
        strategy = weights.get("strategy")
        if strategy in ("channel", "tensor"):
            return cls("compressed-tensors", -1, 1, _names(qc, "ignore"))
        if strategy == "block":
            return cls._blocks("compressed-tensors", weights.get("block_structure"),
                               f"config_groups.{name}.weights.block_structure", _names(qc, "ignore"))
        raise QuantConfigError(f"quantization_config.config_groups.{name}.weights.strategy {strategy!r} is not "
                               f"supported (channel, tensor, block)")

    def keeps_dense(self, module: str) -> bool:
        """Whether `module` was left unquantized (a listed name is one of the module's dotted parts or its dotted
        suffix; `re:...` a regex, compressed-tensors' way)."""
        for m in self.not_converted:
            if m.startswith("re:") and re.search(m[3:], module):
                return True
            if module == m or module.endswith("." + m) or m in module.split("."):
                return True
        return False

    def scheme(self, groups: dict[str, int]) -> QuantScheme:
        return QuantScheme(self.weight_format, self.group_size, "weight_only", (), groups)

    def repack(self, name: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return repack(name, parts, self)


def _names(qc: dict, key: str) -> tuple[str, ...]:
    names = qc.get(key) or []
    if not isinstance(names, list) or not all(isinstance(m, str) and m for m in names):
        raise QuantConfigError(f"quantization_config.{key} {names!r} is not a list of module names")
    return tuple(names)


def repack(name: str, parts: dict[str, torch.Tensor], cfg: Fp8Config) -> dict[str, torch.Tensor]:
    """One FP8 layer's tensors -> {"qweight", "scales"} in our fp8_e4m3 layout (`name` for messages)."""
    weight = parts.get("weight")
    if weight is None:
        raise QuantConfigError(f"{cfg.method} layer {name} lacks its weight")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise QuantConfigError(f"{cfg.method} layer {name}: weight is {weight.dtype} {tuple(weight.shape)}, the "
                               f"format stores a 2-D float8_e4m3fn weight")
    present = [s for s in WEIGHT_SCALES if s in parts]
    if len(present) != 1:
        raise QuantConfigError(f"{cfg.method} layer {name}: expected one of {list(WEIGHT_SCALES)}, found {present}")
    scale = parts[present[0]]
    n, k = weight.shape
    codes = weight.view(torch.uint8)          # NaN codes were refused with the other non-finite weights
    if not scale.is_floating_point() or not bool(torch.isfinite(scale.float()).all()) or bool((scale < 0).any()):
        raise QuantConfigError(f"{cfg.method} layer {name}: {present[0]} is not finite non-negative floats")
    scale = scale.float()
    if cfg.group_size == -1:
        if scale.numel() == 1:                                  # per tensor: the one scale on every row
            scales = scale.reshape(1, 1).expand(n, 1)
        elif tuple(scale.shape) in ((n, 1), (n,)):
            scales = scale.reshape(n, 1)
        else:
            raise QuantConfigError(f"{cfg.method} layer {name}: {present[0]} {tuple(scale.shape)} is neither one "
                                   f"scale nor one a row ({n}, 1) of the {n} x {k} weight")
    else:
        bn, bk = cfg.block_rows, cfg.group_size
        want = (-(-n // bn), -(-k // bk))
        if k % bk:
            raise QuantConfigError(f"{cfg.method} layer {name}: weight_block_size's {bk} inputs do not divide its "
                                   f"{k} input features")
        if tuple(scale.shape) != want:
            raise QuantConfigError(f"{cfg.method} layer {name}: {present[0]} {tuple(scale.shape)} does not match "
                                   f"the {n} x {k} weight in blocks of {bn} x {bk} ({want})")
        scales = scale.repeat_interleave(bn, dim=0)[:n]         # row n: its block row's scales
    return {"qweight": codes.contiguous(), "scales": scales.contiguous()}
