"""Deterministic tiny HF models with random weights and a locally trained tokenizer.

Used by the tests, the examples and the quick start: nothing is downloaded. `build_tiny_model`
writes a HuggingFace folder (config.json, weights, tokenizer files) for one of the `VARIANTS` or of a family's
`TINY_VARIANTS` (models/<family>.py).
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

# the default tiny models (`arch`: the HF architecture, whose transformers class builds it); every family's own are
# its module's TINY_VARIANTS (models/registry.py), found by `tiny_variant`
VARIANTS = {
    # Llama 2 style: multi-head attention, tied embeddings
    "llama_mha_tied": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                           tie_word_embeddings=True),
    # Llama 3 style: grouped-query attention, untied, llama3 rope scaling
    "llama_gqa_llama3": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2_bias_tied": dict(arch="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True),
    # multi-query attention: a single KV head, so a 2-rank pool replicates it
    "llama_mqa": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                      tie_word_embeddings=False),
}


def tiny_variant(name: str) -> dict:
    """The config keys of a tiny variant (a copy): the defaults above or a family's."""
    from allspark_server.models.registry import tiny_variants
    found = VARIANTS.get(name) or tiny_variants().get(name)
    if found is None:
        raise KeyError(f"no tiny variant {name!r}; known: {', '.join(sorted(VARIANTS) + sorted(tiny_variants()))}")
    return dict(found)


def hf_classes(arch: str):
    """(config class, model class) of transformers for an HF architecture name."""
    import transformers
    model_cls = getattr(transformers, arch)
    return model_cls.config_class, model_cls


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
                     vocab_size: int = VOCAB_SIZE, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                     embedding_scale: Optional[float] = None):
    """Create (or overwrite) a tiny HF model folder; returns the transformers model (eval mode). weight_scale: the
    std of every matrix; embedding_scale: of the embedding table and the LM head instead (larger than the layers'
    weights, a residual stream that the embeddings carry and the layers steer)."""
    import torch

    spec = tiny_variant(variant)
    arch = spec.pop("arch")
    norm_noise = spec.pop("norm_noise", None)   # norm weights drawn around their initial value (none: as initialized)
    if num_heads is not None:
        spec["num_attention_heads"] = num_heads
    if num_kv_heads is not None:
        spec["num_key_value_heads"] = num_kv_heads
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, max_position_embeddings=max_position_embeddings,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, **spec)
    cfg_cls, model_cls = hf_classes(arch)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).eval()
    if weight_scale is not None:   # larger weights give peakier, more decisive logits
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, weight_scale)
                elif "bias" in name:
                    p.normal_(0.0, weight_scale)
    if embedding_scale is not None:
        with torch.no_grad():
            for p in {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
                      if m is not None}.values():
                p.normal_(0.0, embedding_scale)
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
