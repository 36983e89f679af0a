"""IBM Granite 3 (`GraniteForCausalLM`) and Granite 3 MoE (`GraniteMoeForCausalLM`): Llama's layer (Mixtral's
routing for the MoE: softmax over the top k of the router's logits) with four scalars of their own, each taken by
something the decoder has:
- `embedding_multiplier`: the embedding rows times it (ModelArgs.embed_scale);
- `attention_multiplier`: q.k times it instead of head_dim ** -0.5 (each Attention step's scale, set by `refine`);
- `residual_multiplier`: each sublayer's output times it, in its dtype, before the next pre-norm adds it to the
  residual stream (each pre-norm's Norm.residual_scale, set by `refine`);
- `logits_scaling`: the logits divided by it. They are linear in the final norm's weight, so the converter divides
  that weight instead: one rounding of the weight in the model's dtype, none where the scaling is a power of two.

GraniteMoE's checkpoints keep each layer's experts in 3-D tensors (`block_sparse_moe.input_linear` [E, 2I, H], gate
rows first, and `output_linear` [E, H, I]; transformers 5 saves them as `experts.gate_up_proj` / `experts.down_proj`)
and the router as `block_sparse_moe.router.layer`: the converter splits them into the decoder's per-expert names.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from allspark_server.compute.steps import Attention, ModelSpec, Norm, Step
from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.description import map_steps
from allspark_server.models.registry import ArchSpec

# (the checkpoint's expert tensor, whether it is gate|up) -> per-expert parts
MOE_EXPERTS = re.compile(r"\.block_sparse_moe\.(input_linear\.weight|output_linear\.weight|experts\.gate_up_proj"
                         r"|experts\.down_proj)$")
MOE_ROUTER = re.compile(r"\.block_sparse_moe\.router\.(layer\.)?weight$")


def read_granite(hf: dict, folder, **moe) -> ModelArgs:
    return args_from_hf_config(
        hf, qkv_bias_always=False, embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        options=dict(attention_multiplier=float(hf.get("attention_multiplier") or 0.0),
                     residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                     logits_scaling=float(hf.get("logits_scaling", 1.0))), **moe)


def read_granite_moe(hf: dict, folder) -> ModelArgs:
    if hf.get("shared_intermediate_size"):
        raise ValueError("GraniteMoE with a shared expert (shared_intermediate_size) is not supported")
    return read_granite(hf, folder, num_experts=int(hf["num_local_experts"]),
                        num_experts_per_tok=int(hf["num_experts_per_tok"]),
                        moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                        moe_layers=tuple(range(int(hf["num_hidden_layers"]))))


def refine(args: ModelArgs, spec: ModelSpec) -> ModelSpec:
    """The attention multiplier as each layer's scale, the residual multiplier on every pre-norm."""
    attention, residual = args.options["attention_multiplier"], args.options["residual_multiplier"]

    def change(step: Step) -> Step:
        if isinstance(step, Attention) and attention:
            return dataclasses.replace(step, scale=attention)
        if isinstance(step, Norm) and step.adds_residual:
            return dataclasses.replace(step, residual_scale=residual)
        return step
    return map_steps(spec, change)


def convert_granite(name: str, t: torch.Tensor, args: ModelArgs):
    if name == "model.norm.weight":      # the final norm, whose weight the logits are linear in
        return ((name, (t.double() / args.options["logits_scaling"]).to(t.dtype)),)
    return ((name, t),)


def convert_granite_moe(name: str, t: torch.Tensor, args: ModelArgs):
    m = MOE_EXPERTS.search(name)
    if m:
        base, inter = name[:m.start()], args.moe_intermediate_size
        if t.dim() != 3 or t.shape[0] != args.num_experts:
            raise ValueError(f"{name}: expected [{args.num_experts}, ...] experts, got {list(t.shape)}")
        if m.group(1) in ("input_linear.weight", "experts.gate_up_proj"):
            if t.shape[1] != 2 * inter:
                raise ValueError(f"{name} has {t.shape[1]} rows per expert; the config implies 2 x {inter}")
            return tuple(item for e in range(args.num_experts) for item in (
                (f"{base}.mlp.experts.{e}.gate_proj.weight", t[e, :inter]),
                (f"{base}.mlp.experts.{e}.up_proj.weight", t[e, inter:])))
        return tuple((f"{base}.mlp.experts.{e}.down_proj.weight", t[e]) for e in range(args.num_experts))
    m = MOE_ROUTER.search(name)
    if m:
        return ((f"{name[:m.start()]}.mlp.gate.weight", t),)
    return convert_granite(name, t, args)


ARCHITECTURES = {
    "GraniteForCausalLM": ArchSpec(read_granite, convert_granite, refine),
    "GraniteMoeForCausalLM": ArchSpec(read_granite_moe, convert_granite_moe, refine),
}
# tiny models (loader/tiny_model.py): the four multipliers at values that bend them (an attention scale twice
# head_dim ** -0.5, a residual share of 0.22, embeddings times 12, logits / 4; / 6 as the released MoE models, which
# the final norm's weight does not carry exactly)
TINY_VARIANTS = {
    "granite": dict(arch="GraniteForCausalLM", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                    logits_scaling=4.0),
    "granitemoe": dict(arch="GraniteMoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                       embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                       logits_scaling=6.0),
}
