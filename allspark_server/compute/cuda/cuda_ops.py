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
from allspark_server.compute import row_mode
from allspark_server.compute.cuda import fused_kernels as fused
from allspark_server.compute.cuda import gemv_kernels, lora_kernels
from allspark_server.compute.cuda.attention_kernels import paged_prefill_attention
from allspark_server.compute.cuda.decode_attention import fused_decode_enabled, paged_decode_attention
from allspark_server.compute.cuda.fp8_matmul import fp8_linear, rounded_rows, takes_fp8_activations
from allspark_server.compute.cuda.graph_capture import for_a_graph
from allspark_server.compute.cuda.lora_dense import dense_lora_add_
from allspark_server.compute.cuda.quant_kernels import alone_config, quant_matmul
from allspark_server.compute.pending_delta import output_and_delta
from allspark_server.compute.steps import Attention
from allspark_server.quant.formats import QuantizedWeight


def linear_reference(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized weight dequantized into fp32 and met by x in fp32 (weight only: x is not rounded, unlike
    the CPU's quantized GEMV; activate_quant: x rounded to int8 per token, or to e4m3 for fp8 weights), one
    rounding into x's dtype."""
    if isinstance(w, QuantizedWeight):
        if takes_fp8_activations(w):
            xf = rounded_rows(x.reshape(-1, x.shape[-1])).float().reshape(x.shape)
        else:
            xf = ref.round_activations_reference(x, 8) if w.act_bits == 8 else x.float()
        return F.linear(xf, w.dequantize().to(x.device), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, w, bias)


def linear(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        if x.dim() != 2 or x.stride(-1) != 1:
            return linear_reference(x, w, bias)
        if takes_fp8_activations(w):
            return fp8_linear(x, w, bias, _alone_config(x, w))
        return quant_matmul(_quant_input(x, w), w, bias, _alone_config(x, w))
    if gemv_kernels.fits(x, w):
        return gemv_kernels.gemv(x, w, bias)
    return F.linear(x, w, bias)


rms_norm = fused.rms_norm
rotary = fused.rotary
silu_mul = fused.silu_mul
gelu_tanh_mul = fused.gelu_tanh_mul
store_kv = ref.store_kv_reference


def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots, k_param=None, v_param=None) -> torch.Tensor:
    """ops.rotary_store_kv: one Triton launch rotates q and k and writes k and v into a dense cache of their dtype
    (fused_kernels.rotary_store_kv, the decode block's); quantized spans take rotary, then the reference's write."""
    if k_param is None and k_cache.dtype == k.dtype == v.dtype:
        return fused.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    q, k = rotary(q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slots, k_param, v_param)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                     ctx: torch.Tensor, options: Attention, k_param: torch.Tensor | None = None,
                     v_param: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] against each sequence's spans -> [B, H, D] (Triton; quantized spans with their params);
    alibi_slopes fp32 [H]: ALiBi's bias; options: the layer's Attention step (scale, softcap, window)."""
    return paged_decode_attention(q, k_cache, v_cache, spans, ctx, options.scale, alibi_slopes=alibi_slopes,
                                  k_param=k_param, v_param=v_param, softcap=options.softcap, window=options.window)


def prefill_attention(q, k_cache, v_cache, meta, options: Attention, out, k_param=None, v_param=None,
                      alibi_slopes=None):
    """Every multi-token chunk of the step in one varlen causal launch (Triton) over the spans; quantized spans
    take the reference's gather-and-SDPA per chunk."""
    if k_param is not None:
        return ref.prefill_attention_reference(q, k_cache, v_cache, meta, options, out, k_param, v_param,
                                               alibi_slopes)
    return paged_prefill_attention(q, k_cache, v_cache, meta.prefill_q_start, meta.prefill_q_len, meta.prefill_ctx,
                                   meta.prefill_spans, options.scale, out=out, max_q_len=meta.prefill_max_q,
                                   alibi_slopes=alibi_slopes, softcap=options.softcap, window=options.window)


def _grouped(x: torch.Tensor) -> bool:
    """Rows past the GEMV's take lora_grouped's launches (A and B read once an adapter), except in the row modes,
    whose rows must come out as the GEMV's one-row launches make them."""
    return x.shape[0] > gemv_kernels.GEMV_MAX_ROWS and not (row_mode.alone() or row_mode.invariant())


def lora_add_(y, x, lora, rows):
    """ops.lora_add_: y += each row's adapter delta, the slots' stacked A and B gathered by row (lora_kernels.py)."""
    a_stack, b_stack = lora.stacked()
    lora_kernels.lora_add_(y, x, a_stack, b_stack, rows.slots, grouped=_grouped(x))
    return y


def takes_lora(lora, lora_rows) -> bool:
    """The projection's adapters take part: rows use adapters, and this projection has some (or, in fixed storage,
    may have some by the time a graph captured now replays)."""
    return lora is not None and lora_rows is not None and (lora.has_fixed_storage or not lora.is_empty)


def lora_linear(x, w, bias, lora, lora_rows, defer: bool = False):
    """linear(x, w, bias) plus the rows' adapter deltas: where the GEMV takes the rows, it carries the adapter's
    shrink in its own launch where it can (gemv_kernels.gemv) and the expand follows; grouped rows of an eager step
    take two GEMMs over every slot (lora_dense.py), those of a CUDA graph run the shrink beside the linear
    (lora_kernels.grouped_lora_linear); elsewhere lora_add_'s launches after the linear. defer: a graph's grouped
    rows run the expand beside the linear too and return a PendingDelta (pending_delta.py) whose reader adds the
    deltas."""
    if not takes_lora(lora, lora_rows):
        return linear(x, w, bias)
    a_stack, b_stack = lora.stacked()
    if isinstance(w, torch.Tensor) and gemv_kernels.fits(x, w):
        return gemv_kernels.gemv(x, w, bias, lora=lora_kernels.Shrink.of(x, a_stack, b_stack, lora_rows.slots))
    if _grouped(x):
        if x.is_cuda and not for_a_graph():     # an eager step, bound by the host's launches
            return dense_lora_add_(linear(x, w, bias), x, lora, lora_rows)
        return lora_kernels.grouped_lora_linear(x, a_stack, b_stack, lora_rows.slots, lambda: linear(x, w, bias),
                                                defer=defer)
    return lora_add_(linear(x, w, bias), x, lora, lora_rows)


def attention_step(x, b, slots, spans, ctx, cos, sin, lora_rows=None):
    """A BoundAttention step (compute/steps.py) on this backend's ops, reference.attention_step_reference's
    sequence (cos = sin = None: no rotary): the o projection's output before the allreduce (a PendingDelta for
    grouped adapter rows)."""
    a, heads, kv_heads = b.step, b.num_heads, b.num_kv_heads
    fused_decode = cos is not None and b.k_param is None and fused_decode_enabled()
    # grouped adapter rows' q|k|v deltas: added by the fused attention's launch as it loads q, k and v (never in
    # alone-rows mode, whose rows take the GEMV's launches and whose verify chunks store k and v first)
    defer = fused_decode and b.q_norm is None and not row_mode.alone()
    qkv = lora_linear(x, b.qkv, b.qkv_bias, b.qkv_lora, lora_rows, defer=defer)
    qkv, delta = output_and_delta(qkv)
    n, d = x.shape[0], qkv.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    if b.q_norm is not None:
        q, k = rms_norm(q.reshape(-1, d), b.q_norm, b.norm_eps)[0], rms_norm(k.reshape(-1, d), b.k_norm, b.norm_eps)[0]
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    if fused_decode:        # rotate q, k, write k, v, attend: one launch
        if row_mode.alone() and n > 1:
            # a verify chunk's rows are one sequence: each attends to the keys the others write, so every row's k
            # and v go into the cache first (the same bits the attention's launch writes again)
            fused.rotary_store_kv(q, k, v, cos, sin, b.k_cache, b.v_cache, slots)
        o = paged_decode_attention(q, b.k_cache, b.v_cache, spans, ctx, a.scale,
                                   rotary=(k, v.view(n, kv_heads, d), cos, sin, slots), alibi_slopes=b.alibi_slopes,
                                   softcap=a.softcap, window=a.window, delta=delta)
    else:
        if cos is not None:   # ALiBi (cos None): no rotary, the bias is the attention's
            q, k = rotary(q, k, cos, sin)
        store_kv(k, v, b.k_cache, b.v_cache, slots, b.k_param, b.v_param)
        o = decode_attention(q, b.k_cache, b.v_cache, spans, ctx, a, b.k_param, b.v_param, b.alibi_slopes)
    return lora_linear(o.reshape(n, heads * d), b.o, None, b.o_lora, lora_rows, defer=True)


def _alone_config(x: torch.Tensor, w: QuantizedWeight, silu_mul: bool = False):
    """In alone-rows mode with several rows: the one-row GEMV's config, a program per row (quant_kernels.alone_config),
    so each row comes out as alone; otherwise None (quant_matmul chooses by the rows)."""
    if not (row_mode.alone() and x.shape[0] > 1):
        return None
    n = w.out_features // 2 if silu_mul else w.out_features
    return alone_config(n, w.in_features, w.group_size, x.device, w.fmt, silu_mul)


def _quant_input(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x as the quantized matmul meets it: activate_quant rounds it to int8 per token, or to e4m3 for fp8 weights
    (torch ops, capturable)."""
    if takes_fp8_activations(w):
        return rounded_rows(x)
    return ref.round_activations_reference(x, 8).to(x.dtype) if w.act_bits == 8 else x


# quantized formats whose GEMV takes silu·mul as its epilogue: the 4-bit ones, where it beats the GEMV plus
# fused_kernels.silu_mul; int8 keeps the two launches, which were as fast (uint4_min: the same 4-bit GEMV, its
# mins one more load per group; benchmarks/results/cuda-quant-silu-h100.json); fp8: benchmarks/cuda_fp8.py --ab-silu
SILU_MUL_QUANT_FORMATS = ("int4", "uint4", "uint4_min", "fp8_e4m3")


def gate_up_silu_mul(h: torch.Tensor, gate_up: "torch.Tensor | QuantizedWeight",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(linear(h, gate_up, bias)): at a decode row, one GEMV launch with silu·mul as its epilogue (dense
    weights, or 4-bit codes without a bias)."""
    if isinstance(gate_up, QuantizedWeight):
        alone = _alone_config(h, gate_up, silu_mul=True)
        if (gate_up.fmt in SILU_MUL_QUANT_FORMATS and bias is None
                and (alone or gemv_kernels.decode_rows(h, gemv_kernels.SILU_MUL_MAX_ROWS))):
            return quant_matmul(_quant_input(h, gate_up), gate_up, config=alone, silu_mul=True)
    elif gemv_kernels.fits_silu_mul(h, gate_up):
        return gemv_kernels.gemv_silu_mul(h, gate_up, bias)
    return silu_mul(linear(h, gate_up, bias))


def mlp_step(x, b, lora_rows=None):
    """A BoundMlp step: silu's gate|up GEMV may take the activation as its epilogue (not where an adapter adds to
    gate|up first; grouped adapter rows' deltas are added by the activation's launch); the down projection's
    output before the allreduce (a PendingDelta for grouped adapter rows)."""
    if takes_lora(b.gate_up_lora, lora_rows):
        gate_up = lora_linear(x, b.gate_up, b.gate_up_bias, b.gate_up_lora, lora_rows, defer=True)
        gate_up, delta = output_and_delta(gate_up)
        a = (silu_mul if b.step.act == "silu" else gelu_tanh_mul)(gate_up, delta=delta)
    elif b.step.act == "silu":
        a = gate_up_silu_mul(x, b.gate_up, b.gate_up_bias)
    else:
        a = gelu_tanh_mul(linear(x, b.gate_up, b.gate_up_bias))
    return lora_linear(a, b.down, None, b.down_lora, lora_rows, defer=True)
