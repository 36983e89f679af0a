"""Baichuan2-7B (RoPE) / Baichuan2-13B (ALiBi) for tests/remote_layouts.py: the remote-code folder written from a
LlamaForCausalLM one, and its references: NormHead's normalized head, the ALiBi slopes and the logits computed as
modeling_baichuan.py does. Import these from remote_layouts.py, which holds the other layouts and the sources."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from remote_layout_io import (
    dtype_name,
    finish_folder,
    num_layers,
    read_config,
    read_state,
    require,
    rope_params,
    source_head,
)
from safetensors.torch import load_file

# --------------------------------------------------------------------------------------------------------------
# Baichuan2-7B (RoPE) / Baichuan2-13B (ALiBi)
# --------------------------------------------------------------------------------------------------------------
#
# modeling_baichuan.py: W_pack = Linear(hidden, 3 * hidden, bias=False), output unflatten(-1, (3, hidden)): rows
# [q; k; v]. 7B: RotaryEmbedding(head_dim) with base 10000 hard-coded (no rope_theta key), neox rotate_half, as
# Llama. 13B: no rotary; an ALiBi bias (alibi_slopes). Both: NormHead lm_head, whose forward uses
# F.normalize(weight) (rows, L2, eps 1e-12; done once in place at the first eval call). MLP gate/up/down as Llama.

_BAICHUAN_MARKER = ("# class NormHead: placeholder so the loader can tell Baichuan2 (NormHead) from Baichuan 1; "
                    "no code\n")


def write_baichuan(src_llama_dir: str, out_dir: str, alibi: bool = False, norm_head: bool = True,
                   architecture: str = "BaichuanForCausalLM", config_overrides: Optional[dict] = None) -> str:
    """Baichuan remote-code layout from a LlamaForCausalLM folder (no biases, kv heads == heads).

    alibi=False: Baichuan2-7B-Chat's config (max_position_embeddings and model_max_length); the source must use
    rope_theta 10000 (Baichuan's base is fixed). alibi=True: Baichuan2-13B-Chat's config (model_max_length only, no
    max_position_embeddings; the source's rope is ignored, so the reference is baichuan_reference_logits).
    norm_head=True: the stored lm_head is the source's, unnormalized, and modeling_baichuan.py is written holding
    only a comment naming NormHead (what the real Baichuan2 folders' file declares); norm_head=False: no modeling
    file (Baichuan 1: plain head). architecture: Baichuan-7B (v1) names itself "BaiChuanForCausalLM"."""
    cfg, state = read_config(src_llama_dir), read_state(src_llama_dir)
    require("LlamaForCausalLM" in (cfg.get("architectures") or []), "not a LlamaForCausalLM folder")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    require(int(cfg.get("num_key_value_heads") or heads) == heads, "grouped-query attention")
    require(int(cfg.get("head_dim") or hidden // heads) * heads == hidden, "head_dim * heads != hidden_size")
    require(not any(k.endswith(".bias") for k in state), "biases (Baichuan has none)")
    require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    if not alibi:
        theta, factor, rope_type = rope_params(cfg)
        require(rope_type == "default" and factor in (None, 1.0), "rope scaling / partial rotary")
        require(abs(theta - 10000.0) < 1e-6, f"rope_theta {theta} (Baichuan2-7B's base is fixed at 10000)")
    dtype = dtype_name(cfg, state)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["model.embed_tokens.weight"]}
    for i in range(num_layers(cfg)):
        p = f"model.layers.{i}."
        out[p + "self_attn.W_pack.weight"] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], 0)
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            out[p + name + ".weight"] = state[p + name + ".weight"]
    out["model.norm.weight"] = state["model.norm.weight"]
    out["lm_head.weight"] = source_head(state)

    positions = int(cfg.get("max_position_embeddings", 4096))
    pad = cfg.get("pad_token_id")
    config = {
        "_from_model_config": True,
        "architectures": [architecture],
        "auto_map": {
            "AutoConfig": "configuration_baichuan.BaichuanConfig",
            "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM",
        },
        "tokenizer_class": "BaichuanTokenizer",
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
    }
    if alibi:
        # configuration_baichuan.py (13B) stores gradient_checkpointing as a 1-tuple, saved as [false]
        config["gradient_checkpointing"] = [False]
    config.update({
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": float(cfg.get("initializer_range", 0.02)),
        "intermediate_size": int(cfg["intermediate_size"]),
    })
    if not alibi:
        config["max_position_embeddings"] = positions
    config.update({
        "model_max_length": positions,
        "model_type": "baichuan",
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers(cfg),
        "pad_token_id": 0 if pad is None else pad,      # Baichuan's configs all say 0
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.29.2",
        "use_cache": True,
        "vocab_size": int(cfg["vocab_size"]),
    })
    finish_folder(src_llama_dir, out_dir, config, out, config_overrides)
    marker = os.path.join(out_dir, "modeling_baichuan.py")
    if norm_head:
        with open(marker, "w") as f:
            f.write(_BAICHUAN_MARKER)
    elif os.path.exists(marker):
        os.remove(marker)
    return out_dir


def normalized_head_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with lm_head.weight rows L2-normalized (NormHead's F.normalize, computed in fp32 and
    cast back): load it into a copy of the source model to get the Baichuan2 reference logits."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = state["lm_head.weight"]
    state["lm_head.weight"] = F.normalize(w.float(), dim=-1).to(w.dtype)
    return state


@torch.no_grad()
def apply_normalized_head(model: torch.nn.Module) -> torch.nn.Module:
    """In place: give the model its own (untied) lm_head normalized as NormHead does; returns the model."""
    w = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(F.normalize(w.float(), dim=-1).to(w.dtype), requires_grad=False)
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False
    return model


def alibi_slopes(n_heads: int) -> list[float]:
    """Baichuan-13B's _get_interleave (the ALiBi paper's slopes): for a power of two n, head h (0-based) gets
    2 ** (-8 (h + 1) / n); otherwise the slopes of the largest power of two p < n, then the first n - p of the
    even-indexed (0, 2, 4, ...) slopes of 2p heads, i.e. 2 ** (-8 (2k + 1) / (2p)), k = 0 .. n - p - 1."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(p) + alibi_slopes(2 * p)[0::2][: n_heads - p]


@torch.no_grad()
def baichuan_reference_logits(folder: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a folder written by write_baichuan, in fp32, computed as modeling_baichuan.py
    does (no padding, no cache): RoPE (base 10000) when config.json has max_position_embeddings, else the ALiBi
    bias slope_h * j added to the causal scores of query i, key j <= i (absolute key position; per query row this is
    the relative -slope_h * (i - j) plus a constant); NormHead when the folder's modeling file names it."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    marker = os.path.join(folder, "modeling_baichuan.py")
    norm_head = cfg["vocab_size"] == 125696 or (os.path.exists(marker) and "NormHead" in open(marker).read())
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    hd = hidden // heads
    bsz, n = input_ids.shape
    rope = "max_position_embeddings" in cfg

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    causal = torch.full((n, n), float("-inf")).triu(1)
    if rope:
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(n).float(), inv)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        bias = causal[None]

        def rot(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin
    else:
        slopes = torch.tensor(alibi_slopes(heads))
        bias = causal[None] + slopes[:, None, None] * torch.arange(n).float()[None, None, :]

        def rot(x):
            return x

    h = sd["model.embed_tokens.weight"][input_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q, k, v = (x @ sd[p + "self_attn.W_pack.weight"].T).split(hidden, -1)
        q, k, v = (t.view(bsz, n, heads, hd).transpose(1, 2) for t in (q, k, v))
        q, k = rot(q), rot(k)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, -1)
        h = h + (att @ v).transpose(1, 2).reshape(bsz, n, hidden) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        x = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + x @ sd[p + "mlp.down_proj.weight"].T
    h = rms(h, sd["model.norm.weight"])
    head = sd["lm_head.weight"]
    return h @ (F.normalize(head, dim=-1) if norm_head else head).T
