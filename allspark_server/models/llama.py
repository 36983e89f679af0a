"""Llama 2/3.x (`LlamaForCausalLM`) and Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the decoder's own layout, so their
checkpoints load as they are. Llama's `attention_bias` biases q/k/v/o; Qwen2 always biases q/k/v, never o."""
from __future__ import annotations

from allspark_server.models.args import args_from_hf_config
from allspark_server.models.registry import ArchSpec

ARCHITECTURES = {
    "LlamaForCausalLM": ArchSpec(lambda hf, folder: args_from_hf_config(hf, qkv_bias_always=False)),
    "Qwen2ForCausalLM": ArchSpec(lambda hf, folder: args_from_hf_config(hf, qkv_bias_always=True)),
}
# tiny models of it (loader/tiny_model.py) besides the defaults there: Llama 3.x / long-context rope scalings, and the
# sources of the remote-code layouts (tests/remote_layouts.py: multi-head, untied)
TINY_VARIANTS = {
    "llama_yarn": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "llama_linear": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_dynamic": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "qwen2_mha": dict(arch="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=False),
    "llama_mha": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=False),
}
