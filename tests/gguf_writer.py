"""Write a transformers model as llama.cpp's converter (convert_hf_to_gguf.py) would: a GGUF file for the tests.

Tensor names come from the gguf package's own name map (gguf.get_tensor_name_map, what the converter uses); the
llama architecture's q / k rows get the converter's permutation (LlamaModel.permute, copied below); Gemma's norms
are stored as 1 + weight; Llama 3's rope scaling becomes rope_freqs.weight (the converter's formula, copied);
experts are stacked ffn_{gate,up,down}_exps. Metadata keys are the converter's (`<arch>.block_count`, ...).
Tensors are quantized with gguf.quants.quantize; the tokenizer metadata (a byte-level BPE) comes from a
tokenizer.json. Nothing here imports allspark: the file is an independent fixture.
"""
from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_type llama3)."""
    rs = cfg.rope_parameters if getattr(cfg, "rope_parameters", None) else cfg.rope_scaling
    base = rs.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _rope(cfg) -> dict:
    rs = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if "full_attention" in rs:
        rs = rs["full_attention"]
    return dict(rs)


def _hf_tensors(model, gguf_arch: str) -> list[tuple[str, np.ndarray]]:
    """(HF-style name, fp32 array) with MoE experts split into gate / up / down stacks [E, N, K]."""
    cfg = model.config
    out = []
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name.endswith("mlp.experts.gate_up_proj"):
            half = a.shape[1] // 2
            out += [(name.replace("gate_up_proj", "gate_proj"), a[:, :half]),
                    (name.replace("gate_up_proj", "up_proj"), a[:, half:])]
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out.append((name, a))
    return out


def write_gguf(model, path: str, weight_type=T.F32, embd_type=T.F32, head_type=None, tokenizer_dir=None,
               chat_template: str | None = None, type_for=None) -> str:
    """Write `model` (fp32 transformers model) to `path`. GEMM weights (2-D, K a multiple of 32) get
    `weight_type`, token_embd `embd_type`, output `head_type` (default: weight_type); `type_for(gguf_name)` may
    override any tensor's type; norms and biases stay F32."""
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny " + cfg.model_type)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = _rope(cfg)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type not in ("default", "llama3"):
        raise ValueError(f"this writer does not write rope {rope_type!r}")
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if tokenizer_dir:
        _add_tokenizer(w, tokenizer_dir, cfg.vocab_size, chat_template)
    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, a in _hf_tensors(model, arch):
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = name, ""
        gname = name_map.get_name(base)
        if gname is None:
            raise ValueError(f"no GGUF name for {name}")
        gname += "." + (suffix or "weight")
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            a = permute(a, heads, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            a = permute(a, heads, kv)
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            a = a + 1
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)
        qtype = T.F32
        if a.ndim >= 2 and a.shape[-1] % 32 == 0:
            head = weight_type if head_type is None else head_type      # (T.F32 is 0: no `or` here)
            qtype = {"token_embd.weight": embd_type, "output.weight": head}.get(gname, weight_type)
        if type_for is not None:
            qtype = type_for(gname) or qtype
        _add(w, gname, a, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, name: str, a: np.ndarray, qtype) -> None:
    if qtype == T.F32:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    elif qtype == T.F16:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float16))
    else:
        raw = qtype_data(a, qtype)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)


def qtype_data(a: np.ndarray, qtype) -> np.ndarray:
    """Raw blocks of `a` in `qtype`: gguf.quants.quantize where the package has it, else (K-quants) random blocks
    (test data for types the package only dequantizes), [*a.shape[:-1], bytes per row]."""
    try:
        return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)
    except NotImplementedError:
        return random_blocks(a.shape, qtype, seed=int(abs(a).sum() * 1000) % 2**31)


# super-block scales that give weights of about N(0, 0.1) with random codes and sub-block scales (a K-quant weight
# is d * sub-scale * code (- dmin * sub-min): 6-bit sub-scales and 4-6-bit codes multiply to hundreds)
K_SCALE = {T.Q2_K: 1e-2, T.Q3_K: 2e-3, T.Q4_K: 5e-4, T.Q5_K: 3e-4, T.Q6_K: 1.5e-4}


def random_blocks(shape, qtype, seed: int = 0, scale: float | None = None) -> np.ndarray:
    """Random raw blocks of a K-quant type with finite, small super-block scales (d, dmin) and random codes
    (of another type: random bytes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    nb = shape[-1] // block
    rng = np.random.default_rng(seed)
    scale = K_SCALE.get(qtype, 0.02) if scale is None else scale
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, size=(rows, nb)) * scale).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    dmin = (rng.uniform(0.0, 1.0, size=(rows, nb)) * scale).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    # where each K-quant keeps its fp16 scales (ggml-common.h block_q*_K)
    at = {T.Q2_K: (size - 4, size - 2), T.Q3_K: (size - 2, None), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
          T.Q6_K: (size - 2, None)}.get(qtype, (None, None))        # other types: random bytes throughout
    if at[0] is not None:
        raw[..., at[0]:at[0] + 2] = d
    if at[1] is not None:
        raw[..., at[1]:at[1] + 2] = dmin
    return raw.reshape(*shape[:-1], nb * size)


def _add_tokenizer(w, tokenizer_dir: str, vocab_size: int, chat_template: str | None) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer model, padded to vocab_size as the
    converter pads ([PAD<i>], user-defined)."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.USER_DEFINED for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special.get("<s>", 0))
    w.add_eos_token_id(special.get("</s>", 1))
    w.add_pad_token_id(special.get("<pad>", 2))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
