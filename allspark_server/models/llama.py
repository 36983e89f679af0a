"""Llama 2/3.x (`LlamaForCausalLM`) and Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the decoder's own layout, so their
checkpoints load as they are. Llama's `attention_bias` biases q/k/v/o; Qwen2 always biases q/k/v, never o."""
from __future__ import annotations

from allspark_server.models.args import args_from_hf_config
from allspark_server.models.registry import ArchSpec

ARCHITECTURES = {
    "LlamaForCausalLM": ArchSpec(lambda hf, folder: args_from_hf_config(hf, qkv_bias_always=False)),
    "Qwen2ForCausalLM": ArchSpec(lambda hf, folder: args_from_hf_config(hf, qkv_bias_always=True)),
}
