"""A GGUF file's metadata as the HF config.json / generation_config.json our registry reads (models/*.py).

`general.architecture` picks the HF architecture (ARCHITECTURES; llama with experts is Mixtral); the
`<arch>.*` keys convert_hf_to_gguf writes give the sizes, rope and norms. What GGUF does not carry is what
llama.cpp assumes for that architecture: Gemma's q.k scale is head_dim ** -0.5 (hidden / heads for the 27B
models, told apart by layer count as llama.cpp does), its sliding layers every other (Gemma 2) or all but every
sixth (Gemma 3, local rope base 10000). Llama 3's rope scaling reaches GGUF only as its per-frequency factors
(`rope_freqs.weight`); `llama3_scaling` finds the llama3 parameters that give exactly those factors.

Nothing from the file is taken on trust: each size must be an integer in its range (counts at least 1, at most
MAX_SIZE; the context at most MAX_CONTEXT), the embedding's shape must agree with the sizes, the file must hold
tensors for every block it declares (checked before any model is built: a skeleton of 10^7 layers costs gigabytes),
floats (norm epsilon, rope base and factors, soft caps) must be finite and positive, token ids must lie in the
vocabulary, and the sampling defaults must pass the checks a request's own values pass. Each failure is a GGUFError
naming the file and the key.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

import numpy as np

from allspark_client.generation_config import ConfigError, parse_generation_config
from allspark_server.loader.gguf_reader import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}     # llama.cpp's LLM_TYPE_27B: q.k scaled by (hidden/heads)**-0.5
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}            # llama.cpp's set_swa_pattern: layer i slides if i % n < n - 1
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# general.sampling.* -> generation_config.json
SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "penalty_repeat": "repetition_penalty"}
# chat turn ends that a template using them stops at (as generation_config.json's eos lists of those models do)
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
MAX_SIZE = 2**31 - 1        # any count or size (the native kernels index with int32)
MAX_CONTEXT = 2**31 - 1     # context_length: positions are int32 too
_MISSING = object()
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def unsupported_message(f: GGUFFile) -> str:
    return (f"{f.path!r}: GGUF architecture {f.architecture!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _bad(f: GGUFFile, key: str, v: Any, want: str) -> GGUFError:
    return GGUFError(f"{f.path!r}: metadata {key!r} is {_show(v)}, {want}")


def _uniform(f: GGUFFile, suffix: str, default=None):
    """A per-model value that newer files may store per layer (a list): all layers must agree."""
    v = f.arch_get(suffix, default)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise GGUFError(f"{f.path!r}: {f.architecture}.{suffix} differs between layers ({_show(v)}); per-layer "
                            f"values are not supported")
        v = v[0]
    return v


def _int(f: GGUFFile, suffix: str, default: Any = _MISSING, low: int = 1, high: int = MAX_SIZE,
         per_layer: bool = False) -> Any:
    """`<arch>.<suffix>` as an integer in [low, high] (`default` when absent; `per_layer`: may be a list)."""
    key = f"{f.architecture}.{suffix}"
    if key not in f.fields and default is not _MISSING:
        return default
    v = _uniform(f, suffix) if per_layer else f.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise _bad(f, key, v, f"not an integer in [{low}, {high}]")
    return v


def _float(f: GGUFFile, key: str, default: float, positive: bool = True) -> float:
    """A finite float, above 0 (`positive`) or at least 0; `default` when absent."""
    v = f.get(key, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise _bad(f, key, v, f"not a finite number {'above' if positive else 'at least'} 0")
    return float(v)


def _token_id(f: GGUFFile, key: str, vocab: int) -> Optional[int]:
    v = f.get(key, None)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
        raise _bad(f, key, v, f"not a token id of the vocabulary [0, {vocab})")
    return v


def _check_blocks(f: GGUFFile, layers: int) -> None:
    """The file holds tensors for each of its `layers` blocks (checked before a model of that many is built)."""
    blocks = {int(m.group(1)) for name in f.tensors if (m := _BLOCK.match(name))}
    missing = next((i for i in range(min(layers, len(blocks) + 1)) if i not in blocks), None)
    if missing is not None:
        raise GGUFError(f"{f.path!r}: metadata '{f.architecture}.block_count' is {layers} but the file holds "
                        f"tensors for {len(blocks)} block(s), none named blk.{missing}.*")


def hf_config(f: GGUFFile) -> dict:
    """The HF config.json this file's metadata stands for (GGUFError names a missing or unsupported value)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(unsupported_message(f))
    hidden, heads = _int(f, "embedding_length"), _int(f, "attention.head_count", per_layer=True)
    kv_heads = _int(f, "attention.head_count_kv", heads, per_layer=True)
    head_dim = (_int(f, "attention.key_length", 0, low=0) or _int(f, "rope.dimension_count", 0, low=0)
                or hidden // heads)
    layers = _int(f, "block_count")
    _check_blocks(f, layers)
    embd = f.tensors.get("token_embd.weight")
    if embd is not None and (len(embd.shape) != 2 or embd.shape[1] != hidden):
        raise GGUFError(f"{f.path!r}: token_embd.weight has shape {list(embd.shape)}, not [vocab, {hidden}] as "
                        f"metadata '{arch}.embedding_length' says")
    vocab = _int(f, "vocab_size", None) or (embd.shape[0] if embd is not None else
                                            len(f.get("tokenizer.ggml.tokens")))
    experts = _int(f, "expert_count", 0, low=0)
    cfg = {
        "architectures": ["MixtralForCausalLM" if arch == "llama" and experts else ARCHITECTURES[arch]],
        "model_type": arch, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": layers, "vocab_size": vocab,
        "intermediate_size": (_int(f, "feed_forward_length", 0, low=0, per_layer=True)
                              or _int(f, "expert_feed_forward_length", 0, low=0)),
        "max_position_embeddings": _int(f, "context_length", 4096, high=MAX_CONTEXT),
        "rms_norm_eps": _float(f, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, positive=False),
        "rope_theta": _float(f, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": _token_id(f, "tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": _token_id(f, "tokenizer.ggml.eos_token_id", vocab),
    }
    scaling = rope_scaling(f, cfg)
    if experts:
        cfg.update(num_experts=experts, num_local_experts=experts,
                   num_experts_per_tok=_int(f, "expert_used_count", high=experts),
                   moe_intermediate_size=_int(f, "expert_feed_forward_length", cfg["intermediate_size"], low=0),
                   shared_expert_intermediate_size=_int(f, "expert_shared_feed_forward_length", 0, low=0),
                   norm_topk_prob=arch != "qwen2moe")     # llama.cpp renormalizes the top k but for Qwen2-MoE
    if arch.startswith("gemma"):
        _gemma(f, cfg, scaling)
    elif scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _gemma(f: GGUFFile, cfg: dict, scaling: Optional[dict]) -> None:
    arch, layers = f.architecture, cfg["num_hidden_layers"]
    big = layers == GEMMA_27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["sliding_window"] = _int(f, "attention.sliding_window", 0, low=0)
    pattern = f.arch_get("attention.sliding_window_pattern", SWA_PATTERN[arch])
    if isinstance(pattern, list):           # newer files: one bool per layer, true where the layer slides
        if len(pattern) != layers:
            raise _bad(f, f"{arch}.attention.sliding_window_pattern", pattern, f"not one value per layer ({layers})")
        slides = [bool(x) for x in pattern]
    else:
        n = _int(f, "attention.sliding_window_pattern", SWA_PATTERN[arch])
        slides = [i % n < n - 1 for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cfg[key] = _float(f, f"{arch}.{key}", 0.0) if f.arch_get(key, 0.0) != 0.0 else 0.0
        if scaling is not None:
            cfg["rope_scaling"] = scaling
    else:
        cfg["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
        cfg["rope_scaling"] = scaling       # the full-attention layers' (the sliding ones rotate unscaled)


def rope_scaling(f: GGUFFile, cfg: dict) -> Optional[dict]:
    """`<arch>.rope.scaling.*` (linear, yarn), or Llama 3's from rope_freqs.weight; None: unscaled."""
    kind = f.arch_get("rope.scaling.type", "none")
    factor = _float(f, f"{f.architecture}.rope.scaling.factor", 1.0) if f.arch_get("rope.scaling.factor", 0) else 1.0
    if "rope_freqs.weight" in f.tensors:
        if kind not in ("none", "linear") or (kind == "linear" and factor != 1.0):
            raise GGUFError(f"{f.path!r}: rope_freqs.weight together with rope scaling {kind!r} is not supported")
        t = f.tensors["rope_freqs.weight"]
        return llama3_scaling(np.asarray(t.data, dtype=np.float32).reshape(-1), cfg["rope_theta"],
                              cfg["head_dim"], f.path)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
               _int(f, "rope.scaling.original_context_length", high=MAX_CONTEXT)}
        for key in ("beta_fast", "beta_slow"):
            if f.arch_get(f"rope.scaling.yarn_{key}", None) is not None:
                out[key] = _float(f, f"{f.architecture}.rope.scaling.yarn_{key}", 0.0, positive=False)
        return out
    raise GGUFError(f"{f.path!r}: rope scaling {kind!r} is not supported (linear, yarn, Llama 3's rope_freqs)")


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """The per-frequency divisors convert_hf_to_gguf writes as rope_freqs.weight for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_scaling(freqs: np.ndarray, theta: float, head_dim: int, path: str) -> Optional[dict]:
    """The llama3 rope_scaling whose factors equal `freqs` (searched over the values released models use)."""
    if np.all(freqs == 1.0):
        return None
    factor = float(freqs.max())
    for old_ctx in (2 ** p for p in range(6, 21)):
        for low in (0.5, 1.0, 2.0, 4.0):
            for high in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
                if high <= low:
                    continue
                if np.allclose(llama3_factors(theta, head_dim, factor, low, high, old_ctx), freqs, rtol=1e-5,
                               atol=0):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
    raise GGUFError(f"{path!r}: rope_freqs.weight holds per-frequency rope factors that match no llama3 rope "
                    f"scaling; other per-frequency factors are not supported")


def generation_config(f: GGUFFile, vocab: int) -> dict:
    """generation_config.json's keys: bos, the eos ids (the file's eos, eot and eom ids, and the chat turn ends
    its chat template uses) and the sampling defaults of general.sampling.*. Ids must lie in [0, vocab); the
    sampling defaults must pass the checks a request's own values pass (a default that fails would fail every
    request that does not set its own, blaming the client)."""
    eos = [_token_id(f, f"tokenizer.ggml.{k}_token_id", vocab) for k in ("eos", "eot", "eom")]
    ids = [i for i in eos if i is not None]
    template = f.get("tokenizer.chat_template", "") or ""
    if not isinstance(template, str):
        raise _bad(f, "tokenizer.chat_template", template, "not a string")
    used = [t for t in CHAT_END_TOKENS if t in template]
    if used:
        tokens = f.get("tokenizer.ggml.tokens", [])
        index = {t: i for i, t in enumerate(tokens) if t in used}
        ids += [index[t] for t in used if t in index and index[t] < vocab]
    out = {"eos_token_id": list(dict.fromkeys(ids))}
    bos = _token_id(f, "tokenizer.ggml.bos_token_id", vocab)
    if bos is not None:
        out["bos_token_id"] = bos
    for key, hf_key in SAMPLING.items():
        v = f.get(f"general.sampling.{key}", None)
        if v is None:
            continue
        try:
            parse_generation_config({hf_key: v})
        except ConfigError as e:
            raise _bad(f, f"general.sampling.{key}", v, f"not a valid default {hf_key} ({e})") from None
        out[hf_key] = v
    if "temperature" in out or "top_k" in out or "top_p" in out:
        out["do_sample"] = True
    return out
