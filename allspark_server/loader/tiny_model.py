"""Deterministic tiny HF models with random weights and a locally trained tokenizer.

Used by the tests, the examples and the quick start: nothing is downloaded. `build_tiny_model`
writes a HuggingFace folder (config.json, weights, tokenizer files) for one of the `VARIANTS`.
"""
from __future__ import annotations

import os
from typing import Optional

VOCAB_SIZE = 512
CORPUS = (
    "The quick brown fox jumps over the lazy dog. allspark serves language models on CPUs and GPUs. "
    "Continuous batching keeps every core busy while requests come and go. A span holds the keys and "
    "values of a few tokens. Hello world! Once upon a time there was a small model that wanted to talk. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Questions? Answers. def main(): return 42\n"
) * 4

VARIANTS = {
    # Llama 2 style: multi-head attention, tied embeddings
    "llama_mha_tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    # Llama 3 style: grouped-query attention, untied, llama3 rope scaling
    "llama_gqa_llama3": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2_bias_tied": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # multi-query attention: a single KV head, so a 2-rank pool replicates it
    "llama_mqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
}
# the other families (tests/models/test_model_families.py); head_dim 16 as the variants above
FAMILY_VARIANTS = {
    # Qwen3: q/k norms per head, no biases, explicit head_dim
    "qwen3": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    # GLM-4 (HF layout): q/k/v bias, fused gate_up, rotary on the first half of each head in interleaved pairs
    "glm": dict(arch="glm", num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                attention_bias=True, partial_rotary_factor=0.5),
    # Llama 3.x / long-context rope scalings
    "llama_yarn": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "llama_linear": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_dynamic": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    # mixtures of experts: 4 experts, top 2 (Qwen2-MoE: a shared expert, layer 1 dense; Qwen3-MoE renormalizes)
    "qwen2_moe": dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    "mixtral": dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    num_local_experts=4, num_experts_per_tok=2),
    # Gemma 2: sandwich norms (weights perturbed, so their 1 + w counts), GELU-tanh, a sliding window of 16 on layer 0
    # (prompts longer than it reach past it), soft caps small enough to bend these tiny models' scores and logits
    "gemma2": dict(arch="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                   sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=8.0, norm_noise=0.2, attn_implementation="eager"),
    # Gemma 3 (text): q/k norms, a local rotary base for the sliding layers (0 and 1 of 2 here), no caps
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                   sliding_window=16, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                   norm_noise=0.2, attn_implementation="eager"),
    # Granite 3 and its MoE: Llama's layer with its four multipliers at values that bend these tiny models (an
    # attention scale twice head_dim ** -0.5, a residual share of 0.22, embeddings times 12, logits / 4)
    "granite": dict(arch="granite", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                    logits_scaling=4.0),
    "granitemoe": dict(arch="granitemoe", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                       attention_multiplier=0.5, residual_multiplier=0.22, logits_scaling=4.0),
    # the sources of the remote-code layouts (tests/remote_layouts.py): multi-head, untied
    "qwen2_mha": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "llama_mha": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
}
ARCH_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "glm": ("GlmConfig", "GlmForCausalLM"),
                "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "granite": ("GraniteConfig", "GraniteForCausalLM"),
                "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM")}


def build_tokenizer(out_dir: str):
    """Train a byte-level BPE tokenizer on the embedded corpus and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: str, variant: str = "llama_gqa_llama3", seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 2048,
                     weight_scale: Optional[float] = None, dtype: str = "float32", tokenizer: bool = True,
                     vocab_size: int = VOCAB_SIZE, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None):
    """Create (or overwrite) a tiny HF model folder; returns the transformers model (eval mode)."""
    import torch
    import transformers

    spec = dict(VARIANTS.get(variant) or FAMILY_VARIANTS[variant])
    arch = spec.pop("arch")
    norm_noise = spec.pop("norm_noise", None)   # norm weights drawn around their initial value (none: as initialized)
    if num_heads is not None:
        spec["num_attention_heads"] = num_heads
    if num_kv_heads is not None:
        spec["num_key_value_heads"] = num_kv_heads
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, max_position_embeddings=max_position_embeddings,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, **spec)
    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCH_CLASSES[arch])
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).eval()
    if weight_scale is not None:   # larger weights give peakier, more decisive logits
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, weight_scale)
                elif "bias" in name:
                    p.normal_(0.0, weight_scale)
    if norm_noise is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * norm_noise)
    model = model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer:
        build_tokenizer(out_dir)
    return model


DEMO_DIR = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "demo")
DEMO_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def demo_model(out_dir: str = DEMO_DIR) -> str:
    """The embedded demo model (the quick start's: a small random Llama with the trained tokenizer) and a chat
    template, created once in `out_dir`; returns the folder. Its text is gibberish, its flow is real."""
    import json
    if not os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        build_tiny_model(out_dir, "llama_gqa_llama3", seed=0, hidden_size=256, num_layers=4, intermediate_size=704,
                         weight_scale=0.05)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("chat_template") != DEMO_CHAT_TEMPLATE:
        cfg["chat_template"] = DEMO_CHAT_TEMPLATE
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return out_dir
