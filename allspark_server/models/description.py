"""Each architecture's decoder layer as data: ModelArgs -> ModelSpec (compute/steps.py), built once per model.

This is the one place that says what a layer computes; the decoder (models/decoder.py) makes its modules from it and
every backend runs it. Llama-style layers: pre-norm attention, pre-norm MLP. Gemma 2 adds a norm on each sublayer's
output (sandwich norms, HF's post_attention_layernorm / post_feedforward_layernorm, with pre_feedforward_layernorm as
the MLP's pre-norm), a GELU-tanh MLP, soft-capped attention scores and a sliding window on alternating layers;
Gemma 3 per-head q/k norms and a rotary table of its own for the sliding layers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from allspark_server.compute.steps import Attention, Mlp, ModelSpec, Moe, Norm, Step
from allspark_server.models.args import ModelArgs
from allspark_server.models.registry import get_arch

# config.json's hidden_act -> compute/steps.py's activation
HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation(args: ModelArgs) -> str:
    if args.hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act {args.hidden_act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")
    return HIDDEN_ACTS[args.hidden_act]


def attention_step(args: ModelArgs, index: int) -> Attention:
    if args.position_embedding not in ("rope", "alibi"):
        raise ValueError(f"position_embedding {args.position_embedding!r} is not supported (rope, alibi)")
    scale = (args.query_pre_attn_scalar or args.head_dim) ** -0.5
    sliding = index in args.sliding_layers
    return Attention(scale=scale, qkv_bias=args.attention_bias, o_bias=args.o_proj_bias, qk_norm=args.qk_norm,
                     position=args.position_embedding, softcap=args.attn_logit_softcapping,
                     window=args.sliding_window if sliding else 0,
                     rope_table=1 if sliding and args.local_rope_theta else 0)


def mlp_step(args: ModelArgs, index: int) -> Step:
    if index in args.moe_layers:
        return Moe(args.num_experts, args.num_experts_per_tok, args.norm_topk_prob,
                   bool(args.shared_expert_intermediate_size))
    return Mlp(activation(args), args.mlp_bias)


def layer_steps(args: ModelArgs, index: int) -> tuple[Step, ...]:
    attention, mlp = attention_step(args, index), mlp_step(args, index)
    if args.sandwich_norms:
        return (Norm("input_layernorm"), attention, Norm("post_attention_layernorm", adds_residual=False),
                Norm("pre_feedforward_layernorm"), mlp, Norm("post_feedforward_layernorm", adds_residual=False))
    return Norm("input_layernorm"), attention, Norm("post_attention_layernorm"), mlp


def map_steps(spec: ModelSpec, change: Callable[[Step], Step]) -> ModelSpec:
    """`spec` with `change` applied to every step of every layer and to the final norm (a family's refine)."""
    return dataclasses.replace(spec, layers=tuple(tuple(change(s) for s in layer) for layer in spec.layers),
                               final_norm=change(spec.final_norm))


def describe(args: ModelArgs) -> ModelSpec:
    """The generic description of args, then the family's own changes (its ArchSpec's refine)."""
    refine = get_arch(args.architecture).refine
    spec = generic_description(args)
    return refine(args, spec) if refine else spec


def generic_description(args: ModelArgs) -> ModelSpec:
    return ModelSpec(layers=tuple(layer_steps(args, i) for i in range(args.num_layers)),
                     embed_scale=args.embed_scale or None, final_softcap=args.final_logit_softcapping)
