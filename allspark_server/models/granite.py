"""IBM Granite 3 (`GraniteForCausalLM`) and Granite 3 MoE (`GraniteMoeForCausalLM`): Llama's layer (Mixtral's
routing for the MoE: softmax over the top k of the router's logits) with four scalars of their own. The embedding
rows are times `embedding_multiplier`, q.k times `attention_multiplier` (instead of head_dim ** -0.5), each
sublayer's output times `residual_multiplier` before it joins the residual stream, and the logits divided by
`logits_scaling`.

GraniteMoE's checkpoints keep each layer's experts in 3-D tensors (`block_sparse_moe.input_linear` [E, 2I, H], gate
rows first, and `output_linear` [E, H, I]; transformers 5 saves them as `experts.gate_up_proj` / `experts.down_proj`)
and the router as `block_sparse_moe.router.layer`: the converter splits them into the decoder's per-expert names.
"""
from __future__ import annotations

import re

import torch

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.registry import ArchSpec

# (the checkpoint's expert tensor, whether it is gate|up) -> per-expert parts
MOE_EXPERTS = re.compile(r"\.block_sparse_moe\.(input_linear\.weight|output_linear\.weight|experts\.gate_up_proj"
                         r"|experts\.down_proj)$")
MOE_ROUTER = re.compile(r"\.block_sparse_moe\.router\.(layer\.)?weight$")


def read_granite(hf: dict, folder, **moe) -> ModelArgs:
    return args_from_hf_config(
        hf, qkv_bias_always=False, embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier") or 0.0),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)), **moe)


def read_granite_moe(hf: dict, folder) -> ModelArgs:
    if hf.get("shared_intermediate_size"):
        raise ValueError("GraniteMoE with a shared expert (shared_intermediate_size) is not supported")
    return read_granite(hf, folder, num_experts=int(hf["num_local_experts"]),
                        num_experts_per_tok=int(hf["num_experts_per_tok"]),
                        moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                        moe_layers=tuple(range(int(hf["num_hidden_layers"]))))


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
    return ((name, t),)


ARCHITECTURES = {
    "GraniteForCausalLM": ArchSpec(read_granite),
    "GraniteMoeForCausalLM": ArchSpec(read_granite_moe, convert_granite_moe),
}
# tiny models (loader/tiny_model.py): the four multipliers at values that bend them (an attention scale twice
# head_dim ** -0.5, a residual share of 0.22, embeddings times 12, logits / 4)
TINY_VARIANTS = {
    "granite": dict(arch="GraniteForCausalLM", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                    logits_scaling=4.0),
    "granitemoe": dict(arch="GraniteMoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                       embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                       logits_scaling=4.0),
}
