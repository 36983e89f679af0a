"""Baichuan-7B and Baichuan2-7B/13B in baichuan-inc's remote-code layout (`BaichuanForCausalLM`), read without
their code: Llama's names with q|k|v fused (`self_attn.W_pack`, split here).

Baichuan2's NormHead normalizes each row of the LM head before use; it is done once here, at load. A folder is
Baichuan2 when its vocabulary is Baichuan2's (125696) or its modeling file defines NormHead. The 13B models
replace the rotary with ALiBi (compute/alibi.py); a folder without `max_position_embeddings` (13B's config has
only `model_max_length`, read as the context) is one of those.
"""
from __future__ import annotations

import glob
import os

import torch

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.convert import split_qkv
from allspark_server.models.registry import ArchSpec

BAICHUAN2_VOCAB = 125696


def has_norm_head(hf: dict, folder) -> bool:
    if int(hf.get("vocab_size", 0)) == BAICHUAN2_VOCAB:
        return True
    for path in glob.glob(os.path.join(folder or "", "modeling_*.py")):
        with open(path, encoding="utf-8", errors="replace") as f:
            if "NormHead" in f.read():
                return True
    return False


def read_args(hf: dict, folder) -> ModelArgs:
    if "max_position_embeddings" in hf:       # 7B: rotary, base 10000
        return args_from_hf_config(hf, qkv_bias_always=False, lm_head_normalized=has_norm_head(hf, folder))
    # 13B: ALiBi; its context is model_max_length (4096 in the published configs)
    hf = dict(hf, max_position_embeddings=int(hf.get("model_max_length", 4096)))
    return args_from_hf_config(hf, qkv_bias_always=False, lm_head_normalized=has_norm_head(hf, folder),
                               position_embedding="alibi")


def convert(name: str, t, args: ModelArgs):
    if name.endswith(".self_attn.W_pack.weight"):
        return split_qkv(t, args, name, name[:-len("self_attn.W_pack.weight")], "weight")
    if name == "lm_head.weight" and args.lm_head_normalized:
        return ((name, torch.nn.functional.normalize(t.float(), dim=-1).to(t.dtype)),)
    return ((name, t),)


# Baichuan-7B (version 1) spells its class BaiChuanForCausalLM
ARCHITECTURES = {"BaichuanForCausalLM": ArchSpec(read_args, convert),
                 "BaiChuanForCausalLM": ArchSpec(read_args, convert)}
