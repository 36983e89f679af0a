"""Rewrite a tiny transformers-native checkpoint as a *remote-code* checkpoint folder, named exactly as the real
public checkpoints name their tensors and config keys, so the loader can be tested on those layouts offline.

    write_chatglm(glm_dir, out)      GlmForCausalLM    -> ChatGLM2/3, glm-4-9b-chat  ("ChatGLMModel")
    write_qwen1(qwen2_dir, out)      Qwen2ForCausalLM  -> Qwen(-7B-Chat) v1          ("QWenLMHeadModel")
    write_baichuan(llama_dir, out)   LlamaForCausalLM  -> Baichuan2-7B / -13B        ("BaichuanForCausalLM")

Each takes the folder written by `save_pretrained` of the native model and returns `out_dir`, which holds
config.json, model.safetensors (tensors in the source dtype) and copies of the source's tokenizer files and
generation_config.json. No folder holds modeling code that anything runs (the one modeling_baichuan.py written is a
single comment line, a marker the loader reads). Every function takes `config_overrides`: keys merged into the
written config.json last, a value of None deleting the key (e.g. {"rope_ratio": None} to test the default).

The references the written folders must reproduce:
- ChatGLM and Qwen v1: the source model itself (same function of the same weights; see the notes by each writer).
  Qwen v1's dynamic NTK and logn attention only act past `seq_length` tokens (qwen_ntk_alpha / qwen_logn_scale).
- Baichuan2 (norm_head=True): the source Llama with its lm_head rows L2-normalized (normalized_head_state or
  apply_normalized_head), because NormHead normalizes the stored rows at run time.
- Baichuan2-13B (alibi=True): a different function (ALiBi instead of RoPE); baichuan_reference_logits runs the
  written folder the way modeling_baichuan.py does, for both variants.

Sources read (facts only): THUDM chatglm3-6b config.json + modeling_chatglm.py (mirror czk1997/chatglm3-copy);
glm-4-9b-chat config.json (as dumped in llama-factory logs) and its modeling_chatglm.py (rope_ratio); transformers'
models/glm/modeling_glm.py + configuration_glm.py and its convert_glm_weights_to_hf.py; Qwen-7B config.json,
generation_config.json, modeling_qwen.py (mirror zhangningboo/Qwen-7B); Baichuan2-7B config.json +
modeling_baichuan.py (mirror mlpod/Baichuan2-CPU-DEBUG, shrunken dims), Baichuan2-13B-Chat modeling_baichuan.py
(mirror jrd77/Baichuan2-13B-Chat), Baichuan 13B configuration_baichuan.py (vllm baichuan_13b.py, Egber1t/Ting-Gong).
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

# Baichuan's writer and references live in baichuan_layout.py; they are imported from here
from baichuan_layout import (
    alibi_slopes,
    apply_normalized_head,
    baichuan_reference_logits,
    normalized_head_state,
    write_baichuan,
)
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

__all__ = ["alibi_slopes", "apply_normalized_head", "baichuan_reference_logits", "normalized_head_state",
           "qwen_logn_scale", "qwen_ntk_alpha", "write_baichuan", "write_chatglm", "write_qwen1"]


# --------------------------------------------------------------------------------------------------------------
# ChatGLM2 / ChatGLM3 / glm-4-9b-chat
# --------------------------------------------------------------------------------------------------------------
#
# Rotary: the same function of the same weights, so q/k rows are copied without any reordering.
#  - transformers GLM (modeling_glm.py): rotary dim = head_dim * partial_rotary_factor (GlmConfig defaults the
#    factor to 0.5); inv_freq_i = theta ** (-2i / rotary_dim), i < rotary_dim / 2; apply_rotary_pos_emb keeps the
#    first half of cos/sin and repeat_interleave(2)s it, and rotate_half is the *interleaved* one
#    (x[0::2], x[1::2] -> stack(-x2, x1)), applied to q[..., :rotary_dim] with the rest passed through. So pair
#    (x[2i], x[2i+1]) at position p turns by angle p * inv_freq_i.
#  - ChatGLM (modeling_chatglm.py): RotaryEmbedding(kv_channels // 2) -> n_elem = kv_channels / 2,
#    theta_i = (10000 * rope_ratio) ** (-2i / n_elem), i < n_elem / 2 (kv_channels / 4 frequencies);
#    apply_rotary_pos_emb: rot_dim = 2 * (kv_channels / 4) = kv_channels / 2, x[..., :rot_dim] reshaped to
#    (rot_dim / 2, 2) pairs (x[2i], x[2i+1]) -> (x0 cos - x1 sin, x1 cos + x0 sin), the rest passed through.
#  Same pairs, same frequencies (head_dim == kv_channels, rotary_dim == kv_channels / 2 when the factor is 0.5,
#  theta == 10000 * rope_ratio), same rotation: identical. transformers' own convert_glm_weights_to_hf.py agrees:
#  it only splits query_key_value into q|k|v rows and copies dense_h_to_4h as gate_up_proj.
# MLP: GLM gate_up_proj -> chunk(2): silu(first) * second; ChatGLM swiglu: chunk(2): silu(x[0]) * x[1]: verbatim.
# Attention scale: both 1/sqrt(head_dim) (ChatGLM's apply_query_key_layer_scaling divides by layer_number and
# multiplies back before the softmax). Norms: RMSNorm, weight * x_normed, in both.
# query_key_value rows are [q (heads*hd); k (groups*hd); v (groups*hd)] only with multi_query_attention true; with
# it false ChatGLM views the rows per head as (heads, 3*hd), i.e. interleaved, so this writer always sets it true.

def write_chatglm(src_glm_dir: str, out_dir: str, flavor: str = "glm4", inv_freq_buffer: bool = True,
                  config_overrides: Optional[dict] = None) -> str:
    """ChatGLM remote-code layout from a GlmForCausalLM folder.

    flavor "glm4": glm-4-9b-chat's config.json (num_hidden_layers beside num_layers, rope_ratio always present);
    flavor "chatglm3": chatglm2-6b / chatglm3-6b's (no num_hidden_layers, rope_ratio only when not 1, as in
    chatglm3-6b-32k). inv_freq_buffer: store transformer.rotary_pos_emb.inv_freq as the real files do (a buffer
    computed with base 10000 whatever rope_ratio is; the model recomputes its table, loaders must drop it)."""
    if flavor not in ("glm4", "chatglm3"):
        raise ValueError(f"flavor {flavor!r}: 'glm4' or 'chatglm3'")
    cfg, state = read_config(src_glm_dir), read_state(src_glm_dir)
    require("GlmForCausalLM" in (cfg.get("architectures") or []), "not a GlmForCausalLM folder")
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, factor, rope_type = rope_params(cfg)
    factor = 0.5 if factor is None else factor
    require(rope_type == "default", f"rope type {rope_type!r} (ChatGLM has plain rope only)")
    require(abs(factor - 0.5) < 1e-9, f"partial_rotary_factor {factor} (ChatGLM rotates exactly half the head)")
    require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    require(heads % kv_heads == 0, "heads not a multiple of kv heads")
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state      # GLM: attention_bias (default true)
    require("model.layers.0.self_attn.o_proj.bias" not in state, "o_proj has a bias (ChatGLM's dense has none)")
    dtype = dtype_name(cfg, state)
    rope_ratio = theta / 10000.0
    if float(rope_ratio).is_integer():
        rope_ratio = int(rope_ratio)

    out: dict[str, torch.Tensor] = {"transformer.embedding.word_embeddings.weight": state["model.embed_tokens.weight"]}
    if inv_freq_buffer:
        torch_dtype = getattr(torch, dtype)
        dim = head_dim // 2
        out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, dim, 2).to(torch_dtype) / dim))
    for i in range(num_layers(cfg)):
        s, d = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        out[d + "input_layernorm.weight"] = state[s + "input_layernorm.weight"]
        out[d + "self_attention.query_key_value.weight"] = torch.cat(
            [state[s + f"self_attn.{p}_proj.weight"] for p in "qkv"], 0)
        if qkv_bias:
            out[d + "self_attention.query_key_value.bias"] = torch.cat(
                [state[s + f"self_attn.{p}_proj.bias"] for p in "qkv"], 0)
        out[d + "self_attention.dense.weight"] = state[s + "self_attn.o_proj.weight"]
        out[d + "post_attention_layernorm.weight"] = state[s + "post_attention_layernorm.weight"]
        out[d + "mlp.dense_h_to_4h.weight"] = state[s + "mlp.gate_up_proj.weight"]     # [gate; up]
        out[d + "mlp.dense_4h_to_h.weight"] = state[s + "mlp.down_proj.weight"]
    out["transformer.encoder.final_layernorm.weight"] = state["model.norm.weight"]
    out["transformer.output_layer.weight"] = source_head(state)

    name = "THUDM/glm-4-9b-chat" if flavor == "glm4" else "THUDM/chatglm3-6b"
    config = {
        "_name_or_path": name,
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "auto_map": {
            "AutoConfig": "configuration_chatglm.ChatGLMConfig",
            "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
        },
        "add_bias_linear": False,
        "add_qkv_bias": qkv_bias,
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "bias_dropout_fusion": True,
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "fp32_residual_connection": False,
        "hidden_dropout": 0.0,
        "hidden_size": hidden,
        "kv_channels": head_dim,
        "layernorm_epsilon": float(cfg.get("rms_norm_eps", 1e-5)),
        "multi_query_attention": True,
        "multi_query_group_num": kv_heads,
        "num_attention_heads": heads,
    }
    if flavor == "glm4":
        config["num_hidden_layers"] = num_layers(cfg)
    config["num_layers"] = num_layers(cfg)
    if flavor == "glm4" or rope_ratio != 1:
        config["rope_ratio"] = rope_ratio
    config.update({
        "original_rope": True,
        "padded_vocab_size": int(cfg["vocab_size"]),
        "post_layer_norm": True,
        "rmsnorm": True,
        "seq_length": int(cfg["max_position_embeddings"]),
        "use_cache": True,
        "torch_dtype": dtype,
        "transformers_version": "4.44.0" if flavor == "glm4" else "4.30.2",
        "tie_word_embeddings": False,
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
    })
    return finish_folder(src_glm_dir, out_dir, config, out, config_overrides)


# --------------------------------------------------------------------------------------------------------------
# Qwen (v1): Qwen-7B / Qwen-7B-Chat / Qwen-14B ...
# --------------------------------------------------------------------------------------------------------------
#
# modeling_qwen.py: c_attn = Linear(hidden, 3 * kv_channels * heads) with a bias always (nn.Linear default), split
# into q|k|v of hidden_size each (so kv_channels * heads must equal hidden_size); c_proj bias = not no_bias.
# QWenMLP: w1, w2: Linear(hidden, intermediate_size // 2); forward a1 = w1(x), a2 = w2(x), a1 * silu(a2), c_proj:
# so w2 is the gate, w1 the up projection, and config intermediate_size is TWICE the MLP width (Qwen-7B: 22016 for
# an 11008-wide MLP). Rotary: neox rotate_half (halves), inv_freq = base ** (-arange(0, dim, 2) / dim), dim =
# kv_channels (rotary_pct 1.0): the same as Qwen2's, no reordering. RMSNorm eps = layer_norm_epsilon.
# Beyond seq_length only (see qwen_ntk_alpha, qwen_logn_scale): dynamic NTK and logn attention, both on in the
# real config. eos/pad are not in Qwen-7B's config.json; they are in generation_config.json (151643).

def write_qwen1(src_qwen2_dir: str, out_dir: str, seq_length: Optional[int] = None, use_dynamic_ntk: bool = True,
                use_logn_attn: bool = True, config_overrides: Optional[dict] = None) -> str:
    """Qwen v1 remote-code layout from a Qwen2ForCausalLM folder (q/k/v biased, no o bias, kv heads == heads).

    seq_length (default: the source's max_position_embeddings) is where Qwen's dynamic NTK and logn attention
    start; below it the written model equals the source. config.json carries no eos/pad/bos ids, as the real one:
    they go to generation_config.json (the source's copy, given the source config's eos/pad ids where it lacks
    them; written with chat_format "chatml" when the source has none)."""
    cfg, state = read_config(src_qwen2_dir), read_state(src_qwen2_dir)
    require("Qwen2ForCausalLM" in (cfg.get("architectures") or []), "not a Qwen2ForCausalLM folder")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    require(kv_heads == heads, "grouped-query attention (Qwen v1 has kv heads == heads)")
    require(head_dim * heads == hidden, "head_dim * heads != hidden_size (Qwen v1 splits c_attn by hidden_size)")
    require("model.layers.0.self_attn.q_proj.bias" in state, "no q/k/v biases (Qwen v1's c_attn always has one)")
    require("model.layers.0.self_attn.o_proj.bias" not in state, "o_proj has a bias (no_bias is true)")
    require(not cfg.get("use_sliding_window", False), "sliding window")
    require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    theta, factor, rope_type = rope_params(cfg)
    require(rope_type == "default", f"rope type {rope_type!r}")
    require(factor in (None, 1.0), "partial rotary")

    out: dict[str, torch.Tensor] = {"transformer.wte.weight": state["model.embed_tokens.weight"]}
    for i in range(num_layers(cfg)):
        s, d = f"model.layers.{i}.", f"transformer.h.{i}."
        out[d + "ln_1.weight"] = state[s + "input_layernorm.weight"]
        out[d + "attn.c_attn.weight"] = torch.cat([state[s + f"self_attn.{p}_proj.weight"] for p in "qkv"], 0)
        out[d + "attn.c_attn.bias"] = torch.cat([state[s + f"self_attn.{p}_proj.bias"] for p in "qkv"], 0)
        out[d + "attn.c_proj.weight"] = state[s + "self_attn.o_proj.weight"]
        out[d + "ln_2.weight"] = state[s + "post_attention_layernorm.weight"]
        out[d + "mlp.w1.weight"] = state[s + "mlp.up_proj.weight"]        # a1 = w1(x): the multiplied branch
        out[d + "mlp.w2.weight"] = state[s + "mlp.gate_proj.weight"]      # a2 = w2(x): silu(a2)
        out[d + "mlp.c_proj.weight"] = state[s + "mlp.down_proj.weight"]
    out["transformer.ln_f.weight"] = state["model.norm.weight"]
    out["lm_head.weight"] = source_head(state)

    positions = int(cfg.get("max_position_embeddings", 8192))
    base = int(theta) if float(theta).is_integer() else theta
    config = {   # key for key Qwen-7B's config.json (the Sept. 2023 revision with hidden_size/num_hidden_layers names)
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
        "attn_dropout_prob": 0.0,
        "bf16": False,
        "emb_dropout_prob": 0.0,
        "fp16": False,
        "fp32": False,
        "hidden_size": hidden,
        "intermediate_size": 2 * int(cfg["intermediate_size"]),
        "initializer_range": float(cfg.get("initializer_range", 0.02)),
        "kv_channels": head_dim,
        "layer_norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": positions,
        "model_type": "qwen",
        "no_bias": True,
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers(cfg),
        "onnx_safe": None,
        "rotary_emb_base": base,
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": int(seq_length or positions),
        "tie_word_embeddings": False,
        "tokenizer_class": "QWenTokenizer",
        "transformers_version": "4.32.0",
        "use_cache": True,
        "use_dynamic_ntk": use_dynamic_ntk,
        "use_flash_attn": "auto",
        "use_logn_attn": use_logn_attn,
        "vocab_size": int(cfg["vocab_size"]),
    }
    # The real config has no torch_dtype key (the precision flags bf16/fp16/fp32 are all false: "auto").
    finish_folder(src_qwen2_dir, out_dir, config, out, config_overrides)
    # Qwen keeps its stop ids in generation_config.json (Qwen-7B: eos = pad = 151643, chat_format), and
    # transformers 5 writes a generation_config.json without them when config.json has them: fill them in.
    path = os.path.join(out_dir, "generation_config.json")
    gen = {"chat_format": "chatml"}
    if os.path.exists(path):
        with open(path) as f:
            gen = json.load(f)
    eos = cfg.get("eos_token_id")
    if gen.get("eos_token_id") is None and eos is not None:
        gen["eos_token_id"] = eos
    if gen.get("pad_token_id") is None and (cfg.get("pad_token_id") is not None or eos is not None):
        gen["pad_token_id"] = cfg["pad_token_id"] if cfg.get("pad_token_id") is not None else eos
    with open(path, "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    return out_dir


def qwen_ntk_alpha(kv_len: int, seq_length: int) -> float:
    """QWenModel.get_ntk_alpha: 2 ** ceil(log2(kv_len / seq_length) + 1) - 1, at least 1 (1 up to seq_length,
    3 up to 2x, 7 up to 4x ...). The rotary base becomes base * alpha ** (dim / (dim - 2)). Computed at prefill
    from the whole (past + new) length, per row from the unpadded length when a mask is given and the length
    exceeds seq_length; decode steps (past present) reuse the alpha of the last prefill."""
    return float(max(2 ** math.ceil(math.log(kv_len / seq_length, 2) + 1) - 1, 1))


def qwen_logn_scale(position: int, seq_length: int) -> float:
    """QWenAttention's logn_tensor: the query at 0-based absolute position p (after rotary) is multiplied by
    log(p + 1) / log(seq_length) when p + 1 > seq_length, else by 1 (the table holds 32767 positions)."""
    return math.log(position + 1, seq_length) if position + 1 > seq_length else 1.0
