"""The layer description's steps (compute/steps.py) on a decode-only batch, on every backend.

A step bound to its layer's tensors (steps.Bound*) runs here as one native call over its descriptor struct
(native/steps.h, filled once per bound step by compute/step_binding.py), as the CUDA backend's sequence
(compute/cuda/cuda_ops.py), or as the torch reference (compute/reference.py) where neither applies. `decode_stack`
builds the native one-call decode step from the same bound steps, so the native stack, the Python loop over the layers
and the CUDA graphs run one description.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from allspark_server.compute import ops, step_binding
from allspark_server.compute.lora_slots import LoraRows
from allspark_server.compute.reference import attention_step_reference, mlp_step_reference
from allspark_server.compute.steps import Bound, BoundAttention, BoundMlp, BoundMoe, BoundNorm


def _native_suits(x: torch.Tensor, *weights) -> bool:
    return (ops.native() is not None and not x.is_cuda and x.dtype in ops.NATIVE_MAX_ROWS
            and all(ops.native_weight_ok(w, x.dtype) for w in weights))


def native_step(b: Bound):
    """The native descriptor of a bound step (made on first use, then kept: weights and caches never move; made
    again when its LoRA adapters change)."""
    version = getattr(b, "lora_version", None)
    if b.native is None or b.native[1] != version:
        b.native = (step_binding.descriptor(b, ops.native(), ops.native_weight), version)
    return b.native[0]


def _lora_slots(rows: Optional[LoraRows]) -> Optional[torch.Tensor]:
    return None if rows is None else rows.slots


def norm_step(x: torch.Tensor, residual: Optional[torch.Tensor], b: BoundNorm):
    """(normed, residual stream): a pre-norm adds the residual first (x scaled first where the step says, in x's
    dtype as HF's Granite does) and returns the sum as the new stream."""
    if b.step.adds_residual:
        if residual is not None and b.step.residual_scale != 1.0:
            x = x * b.step.residual_scale
        return ops.rms_norm(x, b.weight, b.eps, residual)
    return ops.rms_norm(x, b.weight, b.eps)[0], residual


def attention_step(x: torch.Tensor, b: BoundAttention, slots: torch.Tensor, spans: torch.Tensor, ctx: torch.Tensor,
                   cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                   lora_rows: Optional[LoraRows] = None) -> torch.Tensor:
    """x [B, H] (one new token per sequence) -> the o projection's output [B, H] before the allreduce; lora_rows:
    which rows use which LoRA adapter (None: none). On a GPU, grouped adapter rows give a PendingDelta
    (compute/pending_delta.py): the output and the deltas its reader adds."""
    if x.is_cuda:
        return ops.cuda_backend().attention_step(x, b, slots, spans, ctx, cos, sin, lora_rows)
    if (_native_suits(x, b.qkv, b.o) and (b.k_param is not None or b.k_cache.dtype == x.dtype)
            and (cos is None or (cos.shape[-1] % 2 == 0 and cos.dtype == x.dtype))):
        return ops.native().attention_step(x, native_step(b), slots, spans, ctx, cos, sin, ops.isa_level(),
                                           ops.native_rows(x.dtype), _lora_slots(lora_rows))
    return attention_step_reference(x, b, slots, spans, ctx, cos, sin, lora_rows)


def mlp_step(x: torch.Tensor, b: BoundMlp, lora_rows: Optional[LoraRows] = None) -> torch.Tensor:
    """x [B, H] -> the down projection's output before the allreduce (a PendingDelta as attention_step's)."""
    if x.is_cuda:
        return ops.cuda_backend().mlp_step(x, b, lora_rows)
    if _native_suits(x, b.gate_up, b.down):
        return ops.native().mlp_step(x, native_step(b), ops.isa_level(), ops.native_rows(x.dtype),
                                     _lora_slots(lora_rows))
    return mlp_step_reference(x, b, lora_rows)


def moe_step(x: torch.Tensor, b: BoundMoe) -> torch.Tensor:
    """x [B, H] -> the experts' weighted sum before the allreduce; native: only the chosen experts are read."""
    weights = [b.router, *(w for pair in b.experts for w in pair), *(b.shared or ())]
    if _native_suits(x, *weights):
        return ops.native().moe_step(x, native_step(b), ops.isa_level(), ops.native_rows(x.dtype))
    return ops.moe(x, b.router, b.experts, b.step.top_k, b.step.norm_topk_prob, b.shared, b.shared_gate)


def decode_stack(layers: Sequence[Sequence[Bound]], final_norm: BoundNorm, embedding: torch.Tensor,
                 rotary_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], lm_head,
                 embed_scale: Optional[float] = None):
    """A native DecodeStack (native/decode_stack.cpp: a whole decode-only step in one call) over the bound steps of
    every layer; None where the native steps do not apply (then the caller loops over the layers itself, each
    step falling back as above). rotary_tables: each table's fp32 (cos, sin) [positions, D], in the order the
    Attention steps' rope_table counts them (none for ALiBi models)."""
    ext, dtype = ops.native(), embedding.dtype
    if ext is None or embedding.is_cuda or dtype not in ops.NATIVE_MAX_ROWS:
        return None
    for layer in layers:
        for b in layer:
            if isinstance(b, BoundAttention) and (b.k_param is None and b.k_cache.dtype != dtype or (
                    b.step.position == "rope" and rotary_tables[b.step.rope_table][0].shape[-1] % 2)):
                return None
    # its row limit outside alone-rows mode, even if a verify step builds it: verify steps say so per call
    stack = ext.DecodeStack(isa=ops.isa_level(), native_rows=ops.native_rows(dtype, alone=False),
                            embed_scale=embed_scale)
    for layer in layers:
        stack.add_layer([native_step(b) for b in layer])
    stack.set_ends(embedding=embedding, rotary_tables=list(rotary_tables), final_norm=native_step(final_norm),
                   lm_head=ops.native_weight(lm_head))
    return stack
