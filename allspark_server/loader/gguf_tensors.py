"""GGUF tensor data -> our tensors: the block types with an exact mapping kept quantized, the others dequantized.

Exact mappings (one GGUF block of 32 weights along K is one of our groups of 32; codes and scales are copied,
never recomputed; tests/unit/test_gguf_mapping.py checks each against gguf.quants.dequantize bit for bit):
  Q8_0  block: fp16 d, int8 q[32]           w = d * q        -> int8 g32:      qweight = q, scales = d
  Q4_0  block: fp16 d, 16 bytes             w = d * (q - 8)  -> int4 g32:      qweight = the bytes, scales = d
  Q4_1  block: fp16 d, fp16 m, 16 bytes     w = d * q + m    -> uint4_min g32: qweight = the bytes, scales = d,
                                                                                mins = m
In both 4-bit blocks byte j holds element j in its low nibble and element j + 16 in its high one, which is our
pack4 order, and our int4 codes are stored offset by 8 as Q4_0's are: the bytes copy as they are.
Dense: F32 / F16 / BF16 / F64 values, cast to the model's dtype by the caller. Every other block type (K-quants,
Q5_0/Q5_1, IQ*, TQ*, MXFP4...) has no exact mapping: gguf.quants.dequantize gives its fp32 values, which
`requantize` turns into one of our formats (group 32), returning the relative error. Q8_1 / Q8_K (llama.cpp's
activation types), Q1_0 and the integer types are refused, naming the tensor.
"""
from __future__ import annotations

import numpy as np
import torch

from allspark_server.loader.gguf_reader import GGUFError, GGUFTensor
from allspark_server.quant.formats import FORMATS, dequantize, quantize

GROUP = 32


def _types():
    from gguf import GGMLQuantizationType as T
    return T


def exact_format(qtype) -> str | None:
    """Our format holding this GGUF block type exactly (None: none does)."""
    T = _types()
    return {T.Q8_0: "int8", T.Q4_0: "int4", T.Q4_1: "uint4_min"}.get(qtype)


def is_dense(qtype) -> bool:
    T = _types()
    return qtype in (T.F32, T.F16, T.BF16, T.F64)


def default_requant(qtype) -> str:
    """Our format for a block type without an exact mapping: int8 for 5 bits and more, uint4_min below."""
    T = _types()
    return "int8" if qtype in (T.Q6_K, T.Q5_K, T.Q5_0, T.Q5_1) else "uint4_min"


def check_servable(t: GGUFTensor) -> None:
    T = _types()
    refused = {T.Q8_1, T.Q8_K, T.I8, T.I16, T.I32, T.I64} | ({T.Q1_0} if hasattr(T, "Q1_0") else set())
    if t.type in refused:
        raise GGUFError(f"tensor {t.name!r} is of GGML type {t.type_name}, which allspark cannot serve (its "
                        f"weights must be floats or GGML weight blocks)")


def requant_format(qtype, choice) -> str:
    """The user's `gguf_requant` for this type: None (default_requant), one format for all, or a dict
    {GGML type name: format}."""
    fmt = choice.get(qtype.name, default_requant(qtype)) if isinstance(choice, dict) else (
        choice or default_requant(qtype))
    if fmt not in FORMATS:
        raise GGUFError(f"gguf_requant: {fmt!r} is not one of our formats {list(FORMATS)}")
    return fmt


def exact_tensors(raw: np.ndarray, qtype) -> dict[str, torch.Tensor]:
    """Raw blocks [N, K/32 * block bytes] of an exactly mapped type -> {"qweight", "scales"[, "mins"]}."""
    T = _types()
    n = raw.shape[0]
    block_bytes = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}[qtype]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(n, -1, block_bytes)   # off the map
    fp16 = lambda lo: blocks[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].contiguous()   # noqa: E731
    codes_at = 4 if qtype == T.Q4_1 else 2
    codes = blocks[..., codes_at:].reshape(n, -1).contiguous()
    out = {"qweight": codes.view(torch.int8) if qtype == T.Q8_0 else codes, "scales": fp16(0)}
    if qtype == T.Q4_1:
        out["mins"] = fp16(2)
    return out


def dequantized(t: GGUFTensor, index: int | None = None) -> torch.Tensor:
    """The fp32 values of a tensor (of expert `index` of a stacked one) in the torch shape, by gguf's dequantize
    (exact for every type: fp16 / bf16 widen exactly, blocks are computed in fp32)."""
    from gguf.quants import dequantize as gguf_dequantize
    data = t.data if index is None else t.data[index]
    shape = t.shape if index is None else t.shape[1:]
    try:
        values = gguf_dequantize(data, t.type)
    except NotImplementedError:
        raise GGUFError(f"tensor {t.name!r} is of GGML type {t.type_name}, which the gguf package cannot "
                        f"dequantize") from None
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(shape))


def raw_rows(t: GGUFTensor, index: int | None = None) -> np.ndarray:
    """The raw blocks of a 2-D quantized tensor (or of expert `index`) as [rows, bytes per row]."""
    data = t.data if index is None else t.data[index]
    return data.reshape(-1, data.shape[-1])


def requantize(values: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], float]:
    """fp32 [N, K] -> our format `fmt` in groups of 32, and the relative error ||w - w'|| / ||w||."""
    parts = quantize(values, fmt, GROUP)
    back = dequantize(parts["qweight"], parts["scales"], parts.get("zeros", parts.get("mins")), fmt, GROUP)
    norm = float(values.double().norm())
    return parts, float((back.double() - values.double()).norm()) / norm if norm else 0.0


def our_dequantize(parts: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """The fp32 values our tensors of `fmt` (groups of 32) stand for."""
    return dequantize(parts["qweight"], parts["scales"], parts.get("zeros", parts.get("mins")), fmt, GROUP)
