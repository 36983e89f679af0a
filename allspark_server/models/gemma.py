"""Gemma 2 (`Gemma2ForCausalLM`): Llama's projections with a norm on each sublayer's output too (sandwich norms:
post_attention_layernorm after the attention, pre_feedforward_layernorm / post_feedforward_layernorm around the
MLP), a GELU-tanh MLP, embeddings scaled by sqrt(hidden), q.k scaled by query_pre_attn_scalar ** -0.5, attention
scores and final logits soft-capped, and a sliding window on the layers config.json's layer_types calls
"sliding_attention" (by default every other layer, the first included). Gemma 3 (text) adds per-head q/k norms
and a rotary base of its own for the sliding layers (every sixth layer is full by default) and drops the caps.

Gemma's RMSNorm multiplies by (1 + weight): the converter stores 1 + weight (in fp32, rounded once into the model's
dtype), so the decoder's norms are the usual weight * norm.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from allspark_server.models.args import ModelArgs, args_from_hf_config, rope_settings
from allspark_server.models.registry import ArchSpec


def _layer_types(hf: dict, pattern: int) -> list[str]:
    """config.json's layer_types, or the default: every `pattern`-th layer full, the others sliding."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                      for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the {layers} "
                         f"layers, got {types!r}")
    return types


def _gemma_args(hf: dict, types: list[str], **extra) -> ModelArgs:
    window = int(hf.get("sliding_window") or 0)
    args = args_from_hf_config(
        hf, qkv_bias_always=False, sandwich_norms=True, embed_scale=math.sqrt(int(hf["hidden_size"])),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
        attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0), sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (), **extra)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return dataclasses.replace(args, hidden_act=str(act))


def read_args(hf: dict, folder) -> ModelArgs:
    return _gemma_args(hf, _layer_types(hf, 2))


def read_gemma3_args(hf: dict, folder) -> ModelArgs:
    """Gemma 3 (text): Gemma 2's layer plus per-head q/k norms, and the sliding layers' own rotary base. Its
    rope_parameters are keyed by layer type (older configs: rope_theta / rope_scaling for the full layers,
    rope_local_base_freq for the sliding ones)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = dict(rope_theta=hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {}))
        local = dict(rope_theta=hf.get("rope_local_base_freq", 10_000.0))
    local_theta, local_scaling = rope_settings(dict(rope_parameters=local))
    hf = dict(hf, rope_parameters=full)
    hf.pop("rope_scaling", None)
    return _gemma_args(hf, _layer_types(hf, int(hf.get("sliding_window_pattern") or 6)), qk_norm=True,
                       local_rope_theta=local_theta, local_rope_scaling=local_scaling)


def convert(name: str, t: torch.Tensor, args: ModelArgs):
    if name.endswith("norm.weight"):          # every Gemma norm, q/k norms included, is rmsnorm(x) * (1 + weight)
        return ((name, t.float() + 1.0),)
    return ((name, t),)


ARCHITECTURES = {"Gemma2ForCausalLM": ArchSpec(read_args, convert),
                 "Gemma3ForCausalLM": ArchSpec(read_gemma3_args, convert)}
# tiny models (loader/tiny_model.py; norm_noise: norm weights drawn around their initial value, so Gemma's 1 + w
# counts). Gemma 2: a sliding window of 16 on layer 0 (prompts longer than it reach past it), soft caps small enough
# to bend these tiny models' scores and logits; Gemma 3: q/k norms, a local rotary base for the sliding layer, no caps
TINY_VARIANTS = {
    "gemma2": dict(arch="Gemma2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=True, sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=8.0, norm_noise=0.2, attn_implementation="eager"),
    "gemma3": dict(arch="Gemma3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=True, sliding_window=16, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                   norm_noise=0.2, attn_implementation="eager"),
}
