"""Gemma 2 (`Gemma2ForCausalLM`): Llama's projections with a norm on each sublayer's output too (sandwich norms:
post_attention_layernorm after the attention, pre_feedforward_layernorm / post_feedforward_layernorm around the
MLP), a GELU-tanh MLP, embeddings scaled by sqrt(hidden), q.k scaled by query_pre_attn_scalar ** -0.5, attention
scores and final logits soft-capped, and a sliding window on the layers config.json's layer_types calls
"sliding_attention" (by default every other layer, the first included).

Gemma's RMSNorm multiplies by (1 + weight): the converter stores 1 + weight (in fp32, rounded once into the model's
dtype), so the decoder's norms are the usual weight * norm.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.registry import ArchSpec


def read_args(hf: dict, folder) -> ModelArgs:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the {layers} "
                         f"layers, got {types!r}")
    window = int(hf.get("sliding_window") or 0)
    args = args_from_hf_config(
        hf, qkv_bias_always=False, sandwich_norms=True, embed_scale=math.sqrt(int(hf["hidden_size"])),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
        attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0), sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ())
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return dataclasses.replace(args, hidden_act=str(act))


def convert(name: str, t: torch.Tensor, args: ModelArgs):
    if name.endswith("norm.weight"):          # every Gemma norm is rmsnorm(x) * (1 + weight)
        return ((name, t.float() + 1.0),)
    return ((name, t),)


ARCHITECTURES = {"Gemma2ForCausalLM": ArchSpec(read_args, convert)}
