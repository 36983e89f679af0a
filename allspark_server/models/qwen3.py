"""Qwen3 (`Qwen3ForCausalLM`): Llama's layout plus an RMSNorm over each head of q and k before the rotary
(`self_attn.q_norm` / `k_norm`, weights [head_dim]); `attention_bias` as Llama's (false in the released models)."""
from __future__ import annotations

from allspark_server.models.args import args_from_hf_config
from allspark_server.models.registry import ArchSpec

ARCHITECTURES = {
    "Qwen3ForCausalLM": ArchSpec(lambda hf, folder: args_from_hf_config(hf, qkv_bias_always=False, qk_norm=True)),
}
# its tiny model (loader/tiny_model.py): q/k norms per head, no biases, explicit head_dim
TINY_VARIANTS = {"qwen3": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               tie_word_embeddings=False)}
