"""Qwen (v1: Qwen-1.8B/7B/14B-Chat) in its remote-code layout (`QWenLMHeadModel`), read without its code.

GPT-2-style names (`transformer.wte`, `h.<i>.ln_1`, `attn.c_attn` = q|k|v with bias, `attn.c_proj`, `ln_2`,
`mlp.w1`/`w2`/`c_proj`, `ln_f`) mapped onto the decoder's: the MLP is `w1(x) * silu(w2(x))`, so w2 is the gate and
w1 the up projection, and config.json's `intermediate_size` is twice their width. The rotary is Llama's over
`kv_channels * rotary_pct` dims. Qwen's dynamic NTK and logn attention (`use_dynamic_ntk`, `use_logn_attn`, both on
in the released models) only act past `seq_length`, so such a model serves up to seq_length tokens (a longer
max_length is refused, saying why): within it the model is exactly this.
"""
from __future__ import annotations

from allspark_server.models.args import ModelArgs
from allspark_server.models.convert import layer_index, split_qkv
from allspark_server.models.registry import ArchSpec

LAYERS = "transformer.h."
RENAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
LAYER_RENAMES = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                 "attn.c_proj.weight": "self_attn.o_proj.weight", "mlp.w1.weight": "mlp.up_proj.weight",
                 "mlp.w2.weight": "mlp.gate_proj.weight", "mlp.c_proj.weight": "mlp.down_proj.weight"}


def read_args(hf: dict, folder) -> ModelArgs:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("kv_channels") or hidden // heads)
    rotary_dim = int(head_dim * float(hf.get("rotary_pct", 1.0)))
    seq_length = int(hf.get("seq_length") or hf.get("max_position_embeddings", 2048))
    return ModelArgs(
        architecture=hf["architectures"][0], vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]) // 2, num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        rope_theta=float(hf.get("rotary_emb_base", 10000.0)), rope_scaling=None,
        max_position_embeddings=min(seq_length, int(hf.get("max_position_embeddings", seq_length))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=True, o_proj_bias=not hf.get("no_bias", True), mlp_bias=not hf.get("no_bias", True),
        hidden_act="silu", rotary_dim=0 if rotary_dim == head_dim else rotary_dim, **_context_limit(hf, seq_length))


def _context_limit(hf: dict, seq_length: int) -> dict:
    acting = [k for k in ("use_dynamic_ntk", "use_logn_attn") if hf.get(k, True)]   # QWenConfig defaults: on
    if not acting:
        return {}
    return {"context_limit": seq_length,
            "context_limit_reason": f"Qwen's {' and '.join(acting)} (config.json) would act, which allspark does not "
                                    f"implement"}


def convert(name: str, t, args: ModelArgs):
    if name in RENAMES:
        return ((RENAMES[name], t),)
    if name.endswith("rotary_emb.inv_freq"):
        return ()
    if not name.startswith(LAYERS):
        return ((name, t),)                      # reported as unexpected
    i, rest = layer_index(name, LAYERS)
    prefix = f"model.layers.{i}."
    if rest in LAYER_RENAMES:
        return ((prefix + LAYER_RENAMES[rest], t),)
    if rest.startswith("attn.c_attn."):
        # rotary_pct < 1: the first rotary_dim dims rotate, in halves (i, i + r/2): reordered
        return split_qkv(t, args, name, prefix, rest.rsplit(".", 1)[-1], interleaved=False if args.rotary_dim else None)
    return ((name, t),)


ARCHITECTURES = {"QWenLMHeadModel": ArchSpec(read_args, convert)}
