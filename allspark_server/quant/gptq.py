"""GPTQ checkpoints: read a HF folder's `quantization_config` (quant_method gptq) and repack each layer's
qweight / qzeros / scales into InstantQuant's layout (quant/formats.py) without dequantizing.

The published ("classic", AutoGPTQ) format, for a linear layer of K inputs and N outputs, b bits, groups of G:
  qweight  int32 [K * b / 32, N]   32 / b codes per word along K: code of input k at bits (k % (32/b)) * b
  qzeros   int32 [K / G, N * b / 32]  the same packing along N; the zero point of a group is the stored value + 1
  scales   fp16  [K / G, N]
  g_idx    int32 [K]                 group of each input; with desc_act false it is k // G
  w[n, k] = scales[g, n] * (code[k, n] - (qzeros[g, n] + 1)),   g = k // G
which is our uint4 / uint8 with zero = stored + 1 (a zero of 2^b, possible in principle, does not fit uint8 for
8 bits and is refused). desc_act true (groups in activation order) is refused. `bits` / `group_size` written as
whole floats (4.0) are read as their integers; a group size that does not fit the packed tensors is refused naming
their shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from allspark_server.quant.formats import GROUP_SIZES, pack4
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GptqConfig:
    bits: int
    group_size: int
    method: ClassVar[str] = "GPTQ"                 # for messages
    tensors: ClassVar[tuple[str, ...]] = TENSORS   # a layer's checkpoint tensors (`<module>.<part>`)

    @classmethod
    def from_hf(cls, qc: dict) -> "GptqConfig":
        if qc.get("quant_method") != "gptq":
            raise QuantConfigError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
                                   f"(gptq)")
        if qc.get("desc_act", False):
            raise QuantConfigError("quantization_config.desc_act is true (groups in activation order): allspark "
                                   "reads GPTQ checkpoints made with desc_act false only")
        bits = _whole(qc, "bits", None)
        if bits not in (4, 8):
            raise QuantConfigError(f"quantization_config.bits {qc.get('bits')!r} is not supported (4 or 8)")
        group = _whole(qc, "group_size", -1)
        if group not in GROUP_SIZES:
            raise QuantConfigError(f"quantization_config.group_size {qc.get('group_size')!r} is not supported "
                                   f"({list(GROUP_SIZES)})")
        if qc.get("checkpoint_format", "gptq") != "gptq":
            raise QuantConfigError(f"quantization_config.checkpoint_format {qc['checkpoint_format']!r} is not "
                                   f"supported (gptq)")
        return cls(bits, group)

    @property
    def weight_format(self) -> str:
        return "uint4" if self.bits == 4 else "uint8"

    def scheme(self, groups: dict[str, int]) -> QuantScheme:
        return QuantScheme(self.weight_format, self.group_size, "weight_only", (), groups)

    def keeps_dense(self, module: str) -> bool:
        """Whether `module` was left unquantized: never for the GEMM layers of a GPTQ checkpoint we read."""
        return False

    def repack(self, name: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return repack(name, parts, self)


def _whole(qc: dict, key: str, default):
    """quantization_config[key] as an int: JSON writers may store a whole number as 4.0; a fraction, a bool or
    another type is refused naming the key."""
    value = qc.get(key, default)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise QuantConfigError(f"quantization_config.{key} {value!r} is not a whole number")


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned codes, 32 / bits per word, the lowest bits first, unpacked along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:                                               # [K / per, N] -> [K, N]
        codes = (w[:, None, :] >> shifts[None, :, None]) & (2 ** bits - 1)
        return codes.reshape(w.shape[0] * per, w.shape[1])
    codes = (w[:, :, None] >> shifts[None, None, :]) & (2 ** bits - 1)  # [G, N / per] -> [G, N]
    return codes.reshape(w.shape[0], w.shape[1] * per)


def repack(name: str, parts: dict[str, torch.Tensor], cfg: GptqConfig) -> dict[str, torch.Tensor]:
    """One GPTQ layer's tensors -> {"qweight", "scales", "zeros"} in our layout (`name` for messages)."""
    for t in ("qweight", "qzeros", "scales"):
        if t not in parts:
            raise QuantConfigError(f"GPTQ layer {name} lacks {t}")
    for t in ("qweight", "qzeros"):
        if parts[t].dtype != torch.int32 or parts[t].dim() != 2:
            raise QuantConfigError(f"GPTQ layer {name}: {t} is {parts[t].dtype} {tuple(parts[t].shape)}, the "
                                   f"format stores 2-D int32 words")
    codes = _unpack_words(parts["qweight"], cfg.bits, 0)       # [K, N]
    k, n = codes.shape
    group = k if cfg.group_size == -1 else cfg.group_size
    if k % group:
        raise QuantConfigError(f"GPTQ layer {name}: quantization_config.group_size {group} does not divide its {k} "
                               f"input features (qweight {tuple(parts['qweight'].shape)})")
    zeros = _unpack_words(parts["qzeros"], cfg.bits, 1)[:, :n] + 1   # [K / G, N]
    scales = parts["scales"]
    if tuple(scales.shape) != (k // group, n) or tuple(zeros.shape) != (k // group, n):
        raise QuantConfigError(_group_mismatch(name, parts, k, n, cfg))
    if "g_idx" in parts:
        g_idx = parts["g_idx"].to(torch.int64).reshape(-1)
        if not torch.equal(g_idx, torch.arange(k) // group):
            raise QuantConfigError(_g_idx_mismatch(name, g_idx, k, group))
    if int(zeros.max()) > 255:
        raise QuantConfigError(f"GPTQ layer {name}: a zero point of 256 does not fit the uint8 format")
    out_codes = codes.T.contiguous()                           # [N, K]
    qweight = pack4(out_codes) if cfg.bits == 4 else out_codes.to(torch.uint8)
    return {"qweight": qweight, "scales": scales.to(torch.float16).T.contiguous(),
            "zeros": zeros.to(torch.uint8).T.contiguous()}


def _group_mismatch(name: str, parts: dict[str, torch.Tensor], k: int, n: int, cfg: GptqConfig) -> str:
    """Why a layer's scales / qzeros do not fit its qweight in the config's groups, with the group size their shapes
    imply where there is one."""
    groups = 1 if cfg.group_size == -1 else k // cfg.group_size
    stored = parts["scales"].shape[0] if parts["scales"].dim() == 2 else None
    implied = ""
    if stored and k % stored == 0 and tuple(parts["scales"].shape) == (stored, n):
        implied = f"; the packed data holds {stored} group(s) of {k // stored}, so its group_size is {k // stored}"
    return (f"GPTQ layer {name}: scales {tuple(parts['scales'].shape)} / qzeros {tuple(parts['qzeros'].shape)} do "
            f"not match qweight {tuple(parts['qweight'].shape)} ({k} inputs x {n} outputs) in "
            f"quantization_config.group_size {cfg.group_size} ({groups} group(s) of {k // groups}: scales "
            f"({groups}, {n})){implied}")


def _g_idx_mismatch(name: str, g_idx: torch.Tensor, k: int, group: int) -> str:
    """Why g_idx is not k // group: groups of another size than the scales', or inputs out of order."""
    head = f"GPTQ layer {name}: g_idx is not k // {group}"
    if g_idx.numel() != k:
        return f"{head}: it has {g_idx.numel()} entries for {k} input features"
    sizes = torch.bincount(g_idx.clamp(min=0)) if int(g_idx.min()) >= 0 else None
    if sizes is not None and bool((g_idx[1:] >= g_idx[:-1]).all()):
        return (f"{head}: its groups, in order, hold {sorted(set(sizes.tolist()))} inputs each, while the scales "
                f"and quantization_config.group_size give groups of {group}")
    return f"{head}: its inputs are out of order (an activation-order checkpoint, desc_act), which allspark cannot read"
