"""Quantized KV spans: the int8 / uint4 / fp8 row formats of the KV cache and their torch reference.

Each cached row (one token, one KV head, D values) is quantized on its own when it is stored, with
IQ's asymmetric formula (quant/formats.py) over lo = min(x, 0), hi = max(x, 0):
  int8:  scale = (hi - lo) / 255, zero = round(-lo / scale) - 128, code = clamp(round(x / scale) + zero, -128, 127)
  uint4: scale = (hi - lo) / 15,  zero = round(-lo / scale),       code = clamp(round(x / scale) + zero, 0, 15)
and read back as (code - zero) * scale. x / scale is computed as x * (1 / scale) in fp32, the same
arithmetic as the native store (native/kv_quant.h), so codes are bit-equal. A row of zeros has scale 0.
fp8 (GPUs of compute capability 8.9+ only): scale = max|x| / 448, zero = 0, code = float8_e4m3fn(x * (1 / scale))
rounded to nearest even, codes float8_e4m3fn [S, P, KVH, D]; read back as code * scale.
Layout per layer (S spans, P tokens a span, KVH heads): codes int8 [S, P, KVH, D] or uint8 [S, P, KVH, D/2]
(uint4: byte j holds element j in its low nibble and element D/2 + j in its high nibble), and params
fp32 [S, P, KVH, 2] = (scale, zero) per row, as DashInfer's span layout (two floats per token and head).
"""
from __future__ import annotations

import torch

from allspark_server.quant.formats import FP8_MAX

KV_MODES = ("int8", "uint4", "fp8")
NATIVE_KV_MODES = ("int8", "uint4")        # the CPU kernels' (fp8 spans: GPU ranks only)
_RANGE = {"int8": (-128, 127), "uint4": (0, 15)}


def code_width(mode: str, head_dim: int) -> int:
    """Bytes of one row's codes."""
    return head_dim // 2 if mode == "uint4" else head_dim


def code_dtype(mode: str) -> torch.dtype:
    return {"int8": torch.int8, "uint4": torch.uint8, "fp8": torch.float8_e4m3fn}[mode]


def mode_of(codes: torch.Tensor) -> str:
    """The mode a cache of codes is in (the inverse of code_dtype)."""
    return {torch.int8: "int8", torch.uint8: "uint4", torch.float8_e4m3fn: "fp8"}[codes.dtype]


def byte_view(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes as their bytes (torch's index ops have no fp8 kernels, nor can Triton's interpreter fill an fp8
    load); other caches as they are."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def bytes_per_row(mode: str | None, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's row of one KV head takes in the cache (codes + scale + zero when quantized)."""
    if mode is None:
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return code_width(mode, head_dim) + 2 * 4


def quantize_rows(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D or D/2], params fp32 [..., 2])."""
    if mode == "fp8":
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes, torch.cat([scale, torch.zeros_like(scale)], -1)
    lo_code, hi_code = _RANGE[mode]
    levels = hi_code - lo_code
    xf = x.float()
    lo = xf.amin(-1, keepdim=True).clamp(max=0)
    hi = xf.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    zero = torch.round(-lo * inv) + lo_code
    codes = (torch.round(xf * inv) + zero).clamp(lo_code, hi_code)
    params = torch.cat([scale, zero], -1)
    if mode == "int8":
        return codes.to(torch.int8), params
    half = x.shape[-1] // 2
    c = codes.to(torch.uint8)
    return c[..., :half] | (c[..., half:] << 4), params


def dequantize_rows(codes: torch.Tensor, params: torch.Tensor, mode: str) -> torch.Tensor:
    """(codes, params) -> fp32 rows [..., D]."""
    if mode == "uint4":
        codes = torch.cat([codes & 0xF, codes >> 4], -1)
    return (codes.float() - params[..., 1:]) * params[..., :1]
