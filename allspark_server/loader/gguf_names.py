"""GGUF tensor names -> the decoder's checkpoint names (HF Llama's), and which rows llama.cpp permuted.

`blk.N.<part>.weight|bias` -> `model.layers.N.<ours>` (BLOCK; Gemma names its four norms differently: GEMMA);
token_embd / output_norm / output -> the embedding, final norm and LM head. Stacked experts `ffn_*_exps`
[experts, N, K] (and the older one-tensor-per-expert `ffn_*.E`) become `mlp.experts.E.*_proj`, one per expert.

llama.cpp's converter permutes the q and k rows of the llama architecture (Llama, Mistral, Mixtral:
convert_hf_to_gguf LlamaModel.permute) so that each head's rotating pairs are interleaved, (2i, 2i+1), as its
rope rotates them; the other architectures here (qwen2, qwen3, their MoE, gemma2/3) are written unpermuted.
The decoder rotates pairs (i, i + head_dim/2): `unpermute` brings the rows back (convert.py's rotary reorder).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

import torch

from allspark_server.models.args import ModelArgs
from allspark_server.models.convert import reorder_rotary_rows, rotary_dim_order

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
         "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
GEMMA = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
         "post_ffw_norm": "post_feedforward_layernorm"}
IGNORED = ("rope_freqs.weight",)        # Llama 3's rope factors: read into the config (gguf_config.py)
PERMUTED_ARCHITECTURES = ("llama",)
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_STACKED = re.compile(r"^ffn_(gate|up|down)_exps$")
_PER_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)$")


class Target(NamedTuple):
    name: str                    # the decoder's checkpoint name
    expert: Optional[int]        # the index into a stacked experts tensor (None: the whole tensor)


def targets(gguf_name: str, architecture: str, experts: int) -> Optional[list[Target]]:
    """The decoder tensors one GGUF tensor becomes ([] for ignored ones; None: a name we do not know)."""
    if gguf_name in IGNORED:
        return []
    base, _, suffix = gguf_name.rpartition(".")
    if base in TOP and suffix == "weight":
        return [Target(f"{TOP[base]}.weight", None)]
    m = _BLOCK_NAME.match(gguf_name)
    if not m:
        return None
    layer, part, suffix = m.groups()
    prefix = f"model.layers.{layer}."
    stacked, single = _STACKED.match(part), _PER_EXPERT.match(part)
    if stacked:
        return [Target(f"{prefix}mlp.experts.{e}.{stacked.group(1)}_proj.{suffix}", e) for e in range(experts)]
    if single and experts:
        return [Target(f"{prefix}mlp.experts.{single.group(2)}.{single.group(1)}_proj.{suffix}", None)]
    ours = (GEMMA.get(part) if architecture.startswith("gemma") else None) or BLOCK.get(part)
    return [Target(f"{prefix}{ours}.{suffix}", None)] if ours else None


def permuted(name: str, architecture: str) -> bool:
    """Whether llama.cpp's converter permuted this tensor's rows (q / k of the llama architecture)."""
    return architecture in PERMUTED_ARCHITECTURES and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)


def unpermute(t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """q or k rows [heads * head_dim, ...] (weights, biases, codes, scales, mins) with llama.cpp's interleaved
    pairs -> the decoder's layout: our dim i takes the file's 2i, our i + head_dim/2 its 2i + 1."""
    return reorder_rotary_rows(t, args.head_dim, rotary_dim_order(args.head_dim, args.head_dim, interleaved=True))
