"""AWQ checkpoints: read a HF folder's `quantization_config` (quant_method awq, version gemm) and repack each
layer's qweight / qzeros / scales into InstantQuant's uint4 layout (quant/formats.py) without dequantizing.

The published GEMM format (AutoAWQ's `awq/modules/linear/gemm.py` WQLinear_GEMM.from_linear and
`awq/utils/packing_utils.py` dequantize_gemm; read the same way by vLLM's
`vllm/model_executor/layers/quantization/awq_triton.py`), for a linear layer of K inputs and N outputs, 4 bits,
groups of G:
  qweight  int32 [K, N / 8]      8 codes a word, packed along N (GPTQ packs along K)
  qzeros   int32 [K / G, N / 8]  the same packing
  scales   fp16  [K / G, N]
  in word c of a row, nibble i (bits 4i .. 4i + 3) holds column 8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  w[n, k] = scales[g, n] * (code[k, n] - zero[g, n]),   g = k // G   (no +1 on the zeros, unlike GPTQ)
which is exactly our uint4 with its integer zero points. GEMV / Marlin / ExLlama / IPEX versions, other bit
widths, zero_point false and llm-awq's own packing (backend llm-awq) are refused naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from allspark_server.quant.formats import GROUP_SIZES, check_shape, pack4
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

TENSORS = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # column 8c + ORDER[i] of a row sits in nibble i of its word c


def _field(qc: dict, *names, default=None):
    """The first of `names` that the config has (AutoAWQ writes w_bit / q_group_size, transformers bits /
    group_size), with the name it was found under."""
    for name in names:
        if name in qc:
            return qc[name], name
    return default, names[0]


@dataclass(frozen=True)
class AwqConfig:
    group_size: int
    not_converted: tuple[str, ...] = ()     # modules_to_not_convert: modules whose weights stay dense
    bits: ClassVar[int] = 4
    method: ClassVar[str] = "AWQ"                  # for messages
    tensors: ClassVar[tuple[str, ...]] = TENSORS   # a layer's checkpoint tensors (`<module>.<part>`)

    @classmethod
    def from_hf(cls, qc: dict) -> "AwqConfig":
        if qc.get("quant_method") != "awq":
            raise QuantConfigError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
                                   f"(awq)")
        version, key = _field(qc, "version", default="gemm")
        if str(version).lower() != "gemm":
            raise QuantConfigError(f"quantization_config.{key} {version!r} is not supported: allspark reads AWQ "
                                   f"checkpoints in the GEMM packing only")
        backend = qc.get("backend", "autoawq")
        if backend != "autoawq":
            raise QuantConfigError(f"quantization_config.backend {backend!r} is not supported (autoawq)")
        bits, key = _field(qc, "bits", "w_bit")
        if bits != 4:
            raise QuantConfigError(f"quantization_config.{key} {bits!r} is not supported (AWQ GEMM: 4)")
        zero_point, key = _field(qc, "zero_point", default=True)
        if zero_point is not True:
            raise QuantConfigError(f"quantization_config.{key} {zero_point!r} is not supported: allspark reads "
                                   f"AWQ checkpoints with zero points (zero_point true) only")
        group, key = _field(qc, "group_size", "q_group_size")
        if isinstance(group, bool) or group not in GROUP_SIZES:
            raise QuantConfigError(f"quantization_config.{key} {group!r} is not supported ({list(GROUP_SIZES)})")
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) and m for m in skip):
            raise QuantConfigError(f"quantization_config.modules_to_not_convert {skip!r} is not a list of module "
                                   f"names")
        return cls(int(group), tuple(skip))

    @property
    def weight_format(self) -> str:
        return "uint4"

    def keeps_dense(self, module: str) -> bool:
        """Whether `module` was left unquantized (transformers' rule: a listed name is part of the module's)."""
        return any(m in module for m in self.not_converted)

    def scheme(self, groups: dict[str, int]) -> QuantScheme:
        return QuantScheme(self.weight_format, self.group_size, "weight_only", (), groups)

    def repack(self, name: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return repack(name, parts, self)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 words [R, C] -> codes uint8 [R, 8 C] in column order (undoing ORDER)."""
    r, c = words.shape
    w = words.to(torch.int32)
    codes = torch.empty(r, c, 8, dtype=torch.uint8)
    for i, column in enumerate(ORDER):
        codes[:, :, column] = ((w >> (4 * i)) & 0xF).to(torch.uint8)   # an arithmetic shift: the & keeps 4 bits
    return codes.reshape(r, c * 8)


def _fp16(name: str, scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.float16:
        return scales
    half = scales.to(torch.float16)
    if not scales.is_floating_point() or not torch.equal(half.to(scales.dtype), scales):
        raise QuantConfigError(f"AWQ layer {name}: scales of dtype {scales.dtype} are not fp16 values")
    return half


def repack(name: str, parts: dict[str, torch.Tensor], cfg: AwqConfig) -> dict[str, torch.Tensor]:
    """One AWQ GEMM layer's tensors -> {"qweight", "scales", "zeros"} in our layout (`name` for messages)."""
    for t in TENSORS:
        if t not in parts:
            raise QuantConfigError(f"AWQ layer {name} lacks {t}")
    for t in ("qweight", "qzeros"):
        if parts[t].dtype != torch.int32 or parts[t].dim() != 2:
            raise QuantConfigError(f"AWQ layer {name}: {t} is {parts[t].dtype} {tuple(parts[t].shape)}, the GEMM "
                                   f"format stores 2-D int32 words")
    codes = unpack(parts["qweight"])                           # [K, N]
    k, n = codes.shape
    group = k if cfg.group_size == -1 else cfg.group_size
    try:
        check_shape("uint4", cfg.group_size, k, f"AWQ layer {name}")
    except ValueError as e:
        raise QuantConfigError(str(e)) from None
    zeros = unpack(parts["qzeros"])                            # [K / G, N]
    scales = _fp16(name, parts["scales"])
    if tuple(scales.shape) != (k // group, n) or tuple(zeros.shape) != (k // group, n):
        raise QuantConfigError(f"AWQ layer {name}: scales {tuple(scales.shape)} / qzeros "
                               f"{tuple(parts['qzeros'].shape)} do not match qweight's {k} x {n} in groups of {group}")
    return {"qweight": pack4(codes.T.contiguous()), "scales": scales.T.contiguous(), "zeros": zeros.T.contiguous()}
