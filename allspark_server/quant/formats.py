"""InstantQuant weight formats: quantize a [N, K] weight per output channel or per group of K, and the
torch reference that dequantizes it again (what every native quantized kernel is tested against).

Stored tensors of one quantized weight (the `.asparam` names are `<module>.qweight/.scales/.zeros`):
  qweight  int8 [N, K] (int8) | uint8 [N, K] (uint8; fp8_e4m3: the bytes of float8_e4m3fn values)
           | uint8 [N, K/2] (int4, uint4: two 4-bit codes a byte)
  scales   fp16 [N, K/G]  (one column for per-channel, G = -1; fp32 for fp8_e4m3)
  zeros    uint8 [N, K/G] (uint8 / uint4 only: the integer zero point of each group)
  mins     fp16 [N, K/G]  (uint4_min only, in place of zeros: the value code 0 stands for)
4-bit packing, per block of 32 consecutive k: byte j holds k = j in its low nibble and k = 16 + j in its high
nibble (so one 16-byte load yields the block's codes with one AND and one shift). int4 codes are stored
offset by 8 (code 0..15 = value -8..7), so every 4-bit weight dequantizes as (code - zero) * scale with
zero = 8 for int4; uint4_min dequantizes as code * scale + min (llama.cpp's Q4_1 block, which an integer zero
point cannot hold exactly: GGUF Q4_1 files map onto it bit for bit).

Formulas (DashInfer's, ../shared/reference/dashinfer.md §3.4):
  int8 / int4 (symmetric):   scale = m / -128 (int8) or m / -8 (int4), m the group's value of largest
                             magnitude (the full code range is used, as llama.cpp's q8_0/q4_0 do);
                             code = clamp(round(w / scale), -128..127 or -8..7)
  uint8 / uint4 (asymmetric): lo = min(w, 0), hi = max(w, 0); scale = (hi - lo) / 255 (or / 15);
                             zero = clamp(round(-lo / scale)); code = clamp(round(w / scale) + zero)
  uint4_min:                 min = min(w), scale = (max(w) - min) / 15 (both fp16);
                             code = clamp(round((w - min) / scale), 0..15)
  fp8_e4m3 (GPU only):       scale = max|w| / 448 (fp32, 448 = e4m3's largest finite value);
                             code = float8_e4m3fn(w / scale), rounded to nearest even; w = code * scale.
                             OCP FP8's E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities
Scales are rounded to fp16 *before* the codes are computed, so the codes fit the stored scale.
"""
from __future__ import annotations

import torch

FORMATS = ("int8", "uint8", "int4", "uint4", "uint4_min")   # every device: the native CPU kernels and Triton's
GPU_FORMATS = ("fp8_e4m3",)                                # Triton's alone (GPUs of compute capability 8.9+)
ALL_FORMATS = FORMATS + GPU_FORMATS
FORMAT_IDS = {name: i for i, name in enumerate(ALL_FORMATS)}   # the kernels' format numbers
FP8_MAX = 448.0                                            # e4m3's largest finite value
GROUP_SIZES = (-1, 32, 64, 128, 256, 512)
PACK_BLOCK = 32                                            # 4-bit packing block (k elements)


def bits(fmt: str) -> int:
    return 4 if fmt in ("int4", "uint4", "uint4_min") else 8


def is_float(fmt: str) -> bool:
    """Whether the codes are floating-point values (fp8) rather than integers."""
    return fmt in GPU_FORMATS


def is_asymmetric(fmt: str) -> bool:
    """Whether the format stores an offset per group (integer zeros, or mins for uint4_min)."""
    return fmt.startswith("u")


def has_mins(fmt: str) -> bool:
    """Whether the group offset is an fp16 min (the `mins` tensor) rather than an integer zero point."""
    return fmt == "uint4_min"


def _qrange(fmt: str) -> tuple[int, int]:
    return {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15), "uint4_min": (0, 15)}[fmt]


def group_count(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else in_features // group_size


def check_shape(fmt: str, group_size: int, in_features: int, name: str = "weight") -> None:
    """Raise ValueError naming the tensor when `group_size` / the 4-bit packing cannot split its K."""
    if group_size != -1 and in_features % group_size:
        raise ValueError(f"{name}: group_size {group_size} does not divide its {in_features} input features")
    if bits(fmt) == 4 and in_features % PACK_BLOCK:
        raise ValueError(f"{name}: 4-bit formats need the input features ({in_features}) to be a multiple of "
                         f"{PACK_BLOCK}")


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    """w [N, K] (any float dtype) -> {"qweight", "scales"[, "zeros" | "mins"]} in the layout above."""
    if fmt not in ALL_FORMATS:
        raise ValueError(f"weight_format {fmt!r} is not one of {ALL_FORMATS}")
    n, k = w.shape
    check_shape(fmt, group_size, k)
    g = k if group_size == -1 else group_size
    wg = w.detach().float().reshape(n, k // g, g)                             # [N, groups, G]
    if is_float(fmt):
        return _quantize_fp8(wg)
    qmin, qmax = _qrange(fmt)
    out = {}
    if has_mins(fmt):
        lo = wg.amin(-1).half().float()
        scale = ((wg.amax(-1) - lo) / qmax).half().float()
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = torch.round((wg - lo[..., None]) / safe[..., None]).clamp(qmin, qmax)
        out["mins"] = lo.half()
    elif is_asymmetric(fmt):
        lo = wg.amin(-1).clamp(max=0)
        hi = wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax).half().float()                             # [N, groups]
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(-lo / safe).clamp(0, qmax)
        codes = (torch.round(wg / safe[..., None]) + zero[..., None]).clamp(qmin, qmax)
        out["zeros"] = zero.to(torch.uint8)
    else:
        idx = wg.abs().argmax(-1, keepdim=True)
        m = wg.gather(-1, idx)[..., 0]                                        # signed value of largest |w|
        scale = (m / qmin).half().float()
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = torch.round(wg / safe[..., None]).clamp(qmin, qmax)
    codes = codes.reshape(n, k).to(torch.int16)
    if fmt == "int8":
        out["qweight"] = codes.to(torch.int8)
    elif fmt == "uint8":
        out["qweight"] = codes.to(torch.uint8)
    else:
        out["qweight"] = pack4(codes + (8 if fmt == "int4" else 0))
    out["scales"] = scale.half().contiguous()
    return {name: t.contiguous() for name, t in out.items()}


def _quantize_fp8(wg: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, groups, G] fp32 -> fp8_e4m3's qweight (the codes' bytes) and fp32 scales."""
    scale = wg.abs().amax(-1) / FP8_MAX                                      # [N, groups]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (wg / safe[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": codes.view(torch.uint8).reshape(wg.shape[0], -1).contiguous(),
            "scales": scale.contiguous()}


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [N, K] (0..15) -> bytes [N, K/2], per 32-block: low nibble k = j, high k = 16 + j."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // PACK_BLOCK, 2, PACK_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [N, K/2] -> unsigned codes [N, K] (int16), the inverse of pack4."""
    n, half = packed.shape
    b = packed.to(torch.int16).reshape(n, half // (PACK_BLOCK // 2), 1, PACK_BLOCK // 2)
    return torch.cat([b & 0xF, (b >> 4) & 0xF], dim=2).reshape(n, half * 2)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: str,
               group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] that the stored codes stand for: (code - zero) * scale per group, or for
    uint4_min (`zeros` then holds the fp16 mins) code * scale + min, both in fp32 as GGUF readers compute it."""
    if is_float(fmt):
        codes = qweight.view(torch.float8_e4m3fn).float()
    elif bits(fmt) == 4:
        codes = unpack4(qweight).float()
        if fmt == "int4":
            codes = codes - 8
    else:
        codes = qweight.float()
    n, k = codes.shape
    g = k if group_size == -1 else group_size
    codes = codes.reshape(n, k // g, g)
    if has_mins(fmt):
        return (codes * scales.float()[..., None] + zeros.float()[..., None]).reshape(n, k)
    if zeros is not None:
        codes = codes - zeros.float()[..., None]
    return (codes * scales.float()[..., None]).reshape(n, k)


class QuantizedWeight:
    """One quantized weight as the ops take it (a linear layer builds it from its buffers): the stored
    tensors, the format and group size, K (the input features of this rank's shard) and how x is rounded
    before it meets the codes: act_bits 16 (weight-only) or 8 (activate_quant: int8 per token, "A8W8").
    `zeros` is the group offset tensor: uint8 zero points, or the fp16 mins of uint4_min."""

    __slots__ = ("qweight", "scales", "zeros", "fmt", "group_size", "in_features", "act_bits")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: str,
                 group_size: int, in_features: int, act_bits: int = 16):
        if act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 8 or 16, got {act_bits!r}")
        self.qweight, self.scales, self.zeros = qweight, scales, zeros
        self.fmt, self.group_size, self.in_features, self.act_bits = fmt, group_size, in_features, act_bits

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.fmt, self.group_size)
