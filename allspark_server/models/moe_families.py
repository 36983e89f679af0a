"""Mixture-of-experts families: Qwen1.5/2-MoE (`Qwen2MoeForCausalLM`: routed experts plus a shared expert behind a
sigmoid gate), Qwen3-MoE (`Qwen3MoeForCausalLM`: q/k norms, no shared expert) and Mixtral (`MixtralForCausalLM`).

The decoder's names are Qwen-MoE's (`mlp.gate` the router, `mlp.experts.<e>.{gate,up,down}_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`); Mixtral's `block_sparse_moe.gate` and `experts.<e>.w1/w3/w2`
(gate, up, down) are renamed. Which layers are sparse follows Qwen's `mlp_only_layers` and
`decoder_sparse_step` (the others keep a dense MLP of `intermediate_size`); Mixtral's are all sparse.
"""
from __future__ import annotations

import re

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.registry import ArchSpec

MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
MIXTRAL_PARTS = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def _num_experts(hf: dict) -> int:
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def read_qwen_moe(hf: dict, folder, qk_norm: bool, qkv_bias: bool) -> ModelArgs:
    experts, layers = _num_experts(hf), int(hf["num_hidden_layers"])
    step, dense = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return args_from_hf_config(
        hf, qkv_bias_always=qkv_bias, qk_norm=qk_norm, num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]), moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0), moe_layers=sparse)


def read_mixtral(hf: dict, folder) -> ModelArgs:
    return args_from_hf_config(
        hf, qkv_bias_always=False, num_experts=_num_experts(hf), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
        moe_layers=tuple(range(int(hf["num_hidden_layers"]))))


def convert_mixtral(name: str, t, args: ModelArgs):
    m = MIXTRAL_EXPERT.search(name)
    if m:
        base = name[:m.start()]
        return ((f"{base}.mlp.experts.{m.group(1)}.{MIXTRAL_PARTS[m.group(2)]}.weight", t),)
    if name.endswith(".block_sparse_moe.gate.weight"):
        return ((name.replace(".block_sparse_moe.gate.", ".mlp.gate."), t),)
    return ((name, t),)


ARCHITECTURES = {
    "Qwen2MoeForCausalLM": ArchSpec(lambda hf, folder: read_qwen_moe(hf, folder, qk_norm=False, qkv_bias=True)),
    "Qwen3MoeForCausalLM": ArchSpec(lambda hf, folder: read_qwen_moe(hf, folder, qk_norm=True, qkv_bias=False)),
    "MixtralForCausalLM": ArchSpec(read_mixtral, convert_mixtral),
}
# tiny models (loader/tiny_model.py): 4 experts, top 2 (Qwen2-MoE: a shared expert, layer 1 dense; Qwen3-MoE
# renormalizes)
TINY_VARIANTS = {
    "qwen2_moe": dict(arch="Qwen2MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    "mixtral": dict(arch="MixtralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
}
