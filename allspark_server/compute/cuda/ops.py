"""CUDA implementations of `allspark_server.compute.ops`' op names (same signatures, same math).

Linear layers are cuBLAS GEMMs through torch, except decode's row or two against a bf16 / fp16 weight: a Triton
GEMV (gemv_kernels.py), which in the MLP also applies silu·mul; a quantized weight is one Triton matmul over its
codes (quant_kernels.py). Attention over the span cache (quantized spans included), residual + RMSNorm, rotary
(fused with the cache write) and silu·mul are one Triton launch each (attention_kernels.py, decode_attention.py,
fused_kernels.py), rounded as ops' references round; in the decode block rotary, the cache write and the
attention are one launch. Writes into quantized spans are the torch reference's device ops. Nothing here reads
a tensor's values on the host, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from allspark_server.compute import reference as ref
from allspark_server.compute.cuda import fused_kernels as fused
from allspark_server.compute.cuda import gemv_kernels
from allspark_server.compute.cuda.attention_kernels import paged_prefill_attention
from allspark_server.compute.cuda.decode_attention import fused_decode_enabled, paged_decode_attention
from allspark_server.compute.cuda.quant_kernels import quant_matmul
from allspark_server.quant.formats import QuantizedWeight


def linear_reference(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized weight dequantized into fp32 and met by x in fp32 (weight only: x is not rounded, unlike
    the CPU's quantized GEMV; activate_quant: x rounded to int8 per token), one rounding into x's dtype."""
    if isinstance(w, QuantizedWeight):
        xf = ref.round_activations_reference(x, 8) if w.act_bits == 8 else x.float()
        return F.linear(xf, w.dequantize().to(x.device), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, w, bias)


def linear(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        if x.dim() != 2 or x.stride(-1) != 1:
            return linear_reference(x, w, bias)
        return quant_matmul(_quant_input(x, w), w, bias)
    if gemv_kernels.fits(x, w):
        return gemv_kernels.gemv(x, w, bias)
    return F.linear(x, w, bias)


rms_norm = fused.rms_norm
rotary = fused.rotary
silu_mul = fused.silu_mul
store_kv = ref.store_kv_reference


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                     ctx: torch.Tensor, scale: float, k_param: torch.Tensor | None = None,
                     v_param: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] against each sequence's spans -> [B, H, D] (Triton; quantized spans with their params);
    alibi_slopes fp32 [H]: ALiBi's bias."""
    return paged_decode_attention(q, k_cache, v_cache, spans, ctx, scale, alibi_slopes=alibi_slopes,
                                  k_param=k_param, v_param=v_param)


def prefill_attention(q, k_cache, v_cache, meta, scale, out, k_param=None, v_param=None, alibi_slopes=None):
    """Every multi-token chunk of the step in one varlen causal launch (Triton) over the spans; quantized spans
    take the reference's gather-and-SDPA per chunk."""
    if k_param is not None:
        return ref.prefill_attention_reference(q, k_cache, v_cache, meta, scale, out, k_param, v_param, alibi_slopes)
    return paged_prefill_attention(q, k_cache, v_cache, meta.prefill_q_start, meta.prefill_q_len, meta.prefill_ctx,
                                   meta.prefill_spans, scale, out=out, max_q_len=meta.prefill_max_q,
                                   alibi_slopes=alibi_slopes)


def decode_attention_block(x, residual, norm_weight, eps, qkv_weight, qkv_bias, num_heads, num_kv_heads,
                           cos, sin, k_cache, v_cache, slots, spans, ctx, scale, o_weight, k_param=None, v_param=None,
                           q_norm=None, k_norm=None, alibi_slopes=None):
    """ops.decode_attention_block_reference's sequence, on this backend's ops (cos = sin = None: no rotary)."""
    h, s = rms_norm(x, norm_weight, eps, residual)
    qkv = linear(h, qkv_weight, qkv_bias)
    b, d = x.shape[0], qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    if q_norm is not None:
        q, k = rms_norm(q.reshape(-1, d), q_norm, eps)[0], rms_norm(k.reshape(-1, d), k_norm, eps)[0]
    q, k = q.view(b, num_heads, d), k.view(b, num_kv_heads, d)
    if cos is not None and k_param is None and fused_decode_enabled():   # rotate q, k, write k, v, attend: one launch
        o = paged_decode_attention(q, k_cache, v_cache, spans, ctx, scale, alibi_slopes=alibi_slopes,
                                   rotary=(k, v.view(b, num_kv_heads, d), cos, sin, slots))
    else:
        if cos is None:       # ALiBi: no rotary, the bias is the attention's
            store_kv(k, v, k_cache, v_cache, slots, k_param, v_param)
        else:
            q, k = rotary(q, k, cos, sin)
            store_kv(k, v, k_cache, v_cache, slots, k_param, v_param)
        o = decode_attention(q, k_cache, v_cache, spans, ctx, scale, k_param, v_param, alibi_slopes)
    return linear(o.reshape(b, num_heads * d), o_weight), s


def _quant_input(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x as the quantized matmul meets it: activate_quant rounds it to int8 per token (torch ops, capturable)."""
    return ref.round_activations_reference(x, 8).to(x.dtype) if w.act_bits == 8 else x


# quantized formats whose GEMV takes silu·mul as its epilogue: where it was measured faster (an H100, gate_up of
# Llama-2-7B and its 2-rank shard, results-cuda-quant-silu-h100.json): int4 g128 1.10x / 1.14x the GEMV and
# fused_kernels.silu_mul; int8 per channel 0.96x / 1.02x, so 8-bit codes keep the two launches
SILU_MUL_QUANT_FORMATS = ("int4", "uint4")


def gate_up_silu_mul(h: torch.Tensor, gate_up: "torch.Tensor | QuantizedWeight",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(linear(h, gate_up, bias)): at a decode row, one GEMV launch with silu·mul as its epilogue (dense
    weights, or 4-bit codes without a bias)."""
    if isinstance(gate_up, QuantizedWeight):
        if (gate_up.fmt in SILU_MUL_QUANT_FORMATS and bias is None
                and gemv_kernels.decode_rows(h, gemv_kernels.SILU_MUL_MAX_ROWS)):
            return quant_matmul(_quant_input(h, gate_up), gate_up, silu_mul=True)
    elif gemv_kernels.fits_silu_mul(h, gate_up):
        return gemv_kernels.gemv_silu_mul(h, gate_up, bias)
    return silu_mul(linear(h, gate_up, bias))


def decode_mlp_block(x, residual, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight):
    h, s = rms_norm(x, norm_weight, eps, residual)
    return linear(gate_up_silu_mul(h, gate_up_weight, gate_up_bias), down_weight), s
