"""GPTQ checkpoints: read a HF folder's `quantization_config` (quant_method gptq) and repack each layer's
qweight / qzeros / scales into InstantQuant's layout (quant/formats.py) without dequantizing.

The published ("classic", AutoGPTQ) format, for a linear layer of K inputs and N outputs, b bits, groups of G:
  qweight  int32 [K * b / 32, N]   32 / b codes per word along K: code of input k at bits (k % (32/b)) * b
  qzeros   int32 [K / G, N * b / 32]  the same packing along N; the zero point of a group is the stored value + 1
  scales   fp16  [K / G, N]
  g_idx    int32 [K]                 group of each input; with desc_act false it is k // G
  w[n, k] = scales[g, n] * (code[k, n] - (qzeros[g, n] + 1)),   g = k // G
which is our uint4 / uint8 with zero = stored + 1 (a zero of 2^b, possible in principle, does not fit uint8 for
8 bits and is refused). desc_act true (groups in activation order) is refused.
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
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise QuantConfigError(f"quantization_config.bits {bits!r} is not supported (4 or 8)")
        group = qc.get("group_size", -1)
        if group not in GROUP_SIZES:
            raise QuantConfigError(f"quantization_config.group_size {group!r} is not supported ({list(GROUP_SIZES)})")
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
    codes = _unpack_words(parts["qweight"], cfg.bits, 0)       # [K, N]
    k, n = codes.shape
    group = k if cfg.group_size == -1 else cfg.group_size
    if k % group:
        raise QuantConfigError(f"GPTQ layer {name}: group_size {group} does not divide its {k} input features")
    if "g_idx" in parts and not torch.equal(parts["g_idx"].to(torch.int64), torch.arange(k) // group):
        raise QuantConfigError(f"GPTQ layer {name}: g_idx is not k // group_size (an activation-order checkpoint)")
    zeros = _unpack_words(parts["qzeros"], cfg.bits, 1)[:, :n] + 1   # [K / G, N]
    scales = parts["scales"]
    if scales.shape != (k // group, n) or zeros.shape != (k // group, n):
        raise QuantConfigError(f"GPTQ layer {name}: scales {tuple(scales.shape)} / qzeros do not match "
                               f"qweight's {k} x {n} in groups of {group}")
    if int(zeros.max()) > 255:
        raise QuantConfigError(f"GPTQ layer {name}: a zero point of 256 does not fit the uint8 format")
    out_codes = codes.T.contiguous()                           # [N, K]
    qweight = pack4(out_codes) if cfg.bits == 4 else out_codes.to(torch.uint8)
    return {"qweight": qweight, "scales": scales.to(torch.float16).T.contiguous(),
            "zeros": zeros.to(torch.uint8).T.contiguous()}
