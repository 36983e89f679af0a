"""GLM-4 in transformers' layout (`GlmForCausalLM`): Llama's names with gate and up fused (`mlp.gate_up_proj`,
gate rows first), q/k/v biased (`attention_bias`), o never, and a rotary over the first `partial_rotary_factor`
of each head in interleaved pairs, which the converter reorders into the decoder's layout (models/convert.py)."""
from __future__ import annotations

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.convert import split_gate_up, to_rotary_layout
from allspark_server.models.registry import ArchSpec


def read_args(hf: dict, folder) -> ModelArgs:
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return args_from_hf_config(hf, qkv_bias_always=bool(hf.get("attention_bias", True)),
                               rotary_dim=int(head_dim * factor))


def convert(name: str, t, args: ModelArgs):
    if name.endswith(".mlp.gate_up_proj.weight"):
        return split_gate_up(t, args, name, name[:-len("mlp.gate_up_proj.weight")], "weight")
    if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
        return ((name, to_rotary_layout(t, args, interleaved=True)),)
    return ((name, t),)


ARCHITECTURES = {"GlmForCausalLM": ArchSpec(read_args, convert)}
# its tiny model (loader/tiny_model.py): q/k/v bias, fused gate_up, rotary on the first half of each head
TINY_VARIANTS = {"glm": dict(arch="GlmForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False, attention_bias=True, partial_rotary_factor=0.5)}
