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
import shutil
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# --------------------------------------------------------------------------------------------------------------
# reading the native folder, writing the remote one
# --------------------------------------------------------------------------------------------------------------

_TOKENIZER_FIXED = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


def _read_config(src: str) -> dict:
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def _read_state(src: str) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained folder: model.safetensors, a sharded index, or pytorch_model.bin."""
    single = os.path.join(src, "model.safetensors")
    if os.path.exists(single):
        return load_file(single)
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(src, shard)))
        return state
    binary = os.path.join(src, "pytorch_model.bin")
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {src}")


def _dtype_name(cfg: dict, state: dict[str, torch.Tensor]) -> str:
    name = cfg.get("dtype") or cfg.get("torch_dtype")          # transformers 5 writes "dtype", 4.x "torch_dtype"
    if isinstance(name, str):
        return name.replace("torch.", "")
    return str(next(iter(state.values())).dtype).replace("torch.", "")


def _rope(cfg: dict) -> tuple[float, Optional[float], str]:
    """(rope_theta, partial_rotary_factor or None, rope_type) from a 4.x (flat) or 5.x (rope_parameters) config."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(theta), (None if factor is None else float(factor)), rope_type


def _head(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The source's lm_head; a tied model saved without one gets a copy of its embedding (the real remote-code
    checkpoints all store an untied head)."""
    if "lm_head.weight" in state:
        return state["lm_head.weight"]
    return state["model.embed_tokens.weight"].clone()


def _layers(cfg: dict) -> int:
    return int(cfg["num_hidden_layers"])


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"source checkpoint cannot be written in this layout: {what}")


def _finish(src: str, out_dir: str, config: dict, tensors: dict[str, torch.Tensor],
            config_overrides: Optional[dict]) -> str:
    if os.path.abspath(src) == os.path.abspath(out_dir):
        raise ValueError("out_dir must differ from the source folder")
    os.makedirs(out_dir, exist_ok=True)
    for key, value in (config_overrides or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    # safetensors refuses tensors that share storage (a tied head, a view): every tensor gets its own copy.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in sorted(os.listdir(src)):
        if (name.startswith("tokenizer") or name.startswith("chat_template") or name in _TOKENIZER_FIXED
                or name == "generation_config.json"):
            path = os.path.join(src, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(out_dir, name))
    return out_dir


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
    cfg, state = _read_config(src_glm_dir), _read_state(src_glm_dir)
    _require("GlmForCausalLM" in (cfg.get("architectures") or []), "not a GlmForCausalLM folder")
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, factor, rope_type = _rope(cfg)
    factor = 0.5 if factor is None else factor
    _require(rope_type == "default", f"rope type {rope_type!r} (ChatGLM has plain rope only)")
    _require(abs(factor - 0.5) < 1e-9, f"partial_rotary_factor {factor} (ChatGLM rotates exactly half the head)")
    _require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    _require(heads % kv_heads == 0, "heads not a multiple of kv heads")
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state      # GLM: attention_bias (default true)
    _require("model.layers.0.self_attn.o_proj.bias" not in state, "o_proj has a bias (ChatGLM's dense has none)")
    dtype = _dtype_name(cfg, state)
    rope_ratio = theta / 10000.0
    if float(rope_ratio).is_integer():
        rope_ratio = int(rope_ratio)

    out: dict[str, torch.Tensor] = {"transformer.embedding.word_embeddings.weight": state["model.embed_tokens.weight"]}
    if inv_freq_buffer:
        torch_dtype = getattr(torch, dtype)
        dim = head_dim // 2
        out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, dim, 2).to(torch_dtype) / dim))
    for i in range(_layers(cfg)):
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
    out["transformer.output_layer.weight"] = _head(state)

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
        config["num_hidden_layers"] = _layers(cfg)
    config["num_layers"] = _layers(cfg)
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
    return _finish(src_glm_dir, out_dir, config, out, config_overrides)


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
    cfg, state = _read_config(src_qwen2_dir), _read_state(src_qwen2_dir)
    _require("Qwen2ForCausalLM" in (cfg.get("architectures") or []), "not a Qwen2ForCausalLM folder")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    _require(kv_heads == heads, "grouped-query attention (Qwen v1 has kv heads == heads)")
    _require(head_dim * heads == hidden, "head_dim * heads != hidden_size (Qwen v1 splits c_attn by hidden_size)")
    _require("model.layers.0.self_attn.q_proj.bias" in state, "no q/k/v biases (Qwen v1's c_attn always has one)")
    _require("model.layers.0.self_attn.o_proj.bias" not in state, "o_proj has a bias (no_bias is true)")
    _require(not cfg.get("use_sliding_window", False), "sliding window")
    _require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    theta, factor, rope_type = _rope(cfg)
    _require(rope_type == "default", f"rope type {rope_type!r}")
    _require(factor in (None, 1.0), "partial rotary")

    out: dict[str, torch.Tensor] = {"transformer.wte.weight": state["model.embed_tokens.weight"]}
    for i in range(_layers(cfg)):
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
    out["lm_head.weight"] = _head(state)

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
        "num_hidden_layers": _layers(cfg),
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
    _finish(src_qwen2_dir, out_dir, config, out, config_overrides)
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
    cfg, state = _read_config(src_llama_dir), _read_state(src_llama_dir)
    _require("LlamaForCausalLM" in (cfg.get("architectures") or []), "not a LlamaForCausalLM folder")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    _require(int(cfg.get("num_key_value_heads") or heads) == heads, "grouped-query attention")
    _require(int(cfg.get("head_dim") or hidden // heads) * heads == hidden, "head_dim * heads != hidden_size")
    _require(not any(k.endswith(".bias") for k in state), "biases (Baichuan has none)")
    _require(cfg.get("hidden_act", "silu") == "silu", "hidden_act is not silu")
    if not alibi:
        theta, factor, rope_type = _rope(cfg)
        _require(rope_type == "default" and factor in (None, 1.0), "rope scaling / partial rotary")
        _require(abs(theta - 10000.0) < 1e-6, f"rope_theta {theta} (Baichuan2-7B's base is fixed at 10000)")
    dtype = _dtype_name(cfg, state)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["model.embed_tokens.weight"]}
    for i in range(_layers(cfg)):
        p = f"model.layers.{i}."
        out[p + "self_attn.W_pack.weight"] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], 0)
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            out[p + name + ".weight"] = state[p + name + ".weight"]
    out["model.norm.weight"] = state["model.norm.weight"]
    out["lm_head.weight"] = _head(state)

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
        "num_hidden_layers": _layers(cfg),
        "pad_token_id": 0 if pad is None else pad,      # Baichuan's configs all say 0
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.29.2",
        "use_cache": True,
        "vocab_size": int(cfg["vocab_size"]),
    })
    _finish(src_llama_dir, out_dir, config, out, config_overrides)
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
