"""ChatGLM2-6B, ChatGLM3-6B and GLM-4-9B-Chat in THUDM's remote-code layout (`ChatGLMModel`), read without their code.

From their config.json: `kv_channels` per head, multi-query groups (`multi_query_group_num`), `ffn_hidden_size`,
`padded_vocab_size`, `seq_length`, base 10000 x `rope_ratio`, `add_qkv_bias`, `add_bias_linear`. The layer is the
decoder's: RMSNorm, fused q|k|v (`query_key_value`, split here), fused gate|up (`dense_h_to_4h`, gate first), a
rotary over the first half of each head in interleaved pairs (reordered here, models/convert.py).
"""
from __future__ import annotations

from allspark_server.models.args import ModelArgs
from allspark_server.models.convert import layer_index, split_gate_up, split_qkv
from allspark_server.models.registry import ArchSpec

LAYERS = "transformer.encoder.layers."
RENAMES = {"transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "transformer.encoder.final_layernorm.weight": "model.norm.weight",
           "transformer.output_layer.weight": "lm_head.weight"}
LAYER_RENAMES = {"input_layernorm.weight": "input_layernorm.weight",
                 "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                 "self_attention.dense.weight": "self_attn.o_proj.weight",
                 "self_attention.dense.bias": "self_attn.o_proj.bias",
                 "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
                 "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias"}
# the variants of the remote code this reader does not implement: (key, the value it needs)
REQUIRED = (("rmsnorm", True), ("apply_residual_connection_post_layernorm", False), ("post_layer_norm", True),
            ("original_rope", True))


def read_args(hf: dict, folder) -> ModelArgs:
    for key, value in REQUIRED:
        if key in hf and bool(hf[key]) != value:
            raise ValueError(f"ChatGLMModel with {key}={hf[key]!r} is not supported (only {key}={value})")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("kv_channels") or hidden // heads)
    linear_bias = bool(hf.get("add_bias_linear", False))
    return ModelArgs(
        architecture=hf["architectures"][0], vocab_size=int(hf["padded_vocab_size"]), hidden_size=hidden,
        intermediate_size=int(hf["ffn_hidden_size"]), num_layers=int(hf["num_layers"]), num_heads=heads,
        num_kv_heads=int(hf["multi_query_group_num"]) if hf.get("multi_query_attention") else heads,
        head_dim=head_dim, rms_norm_eps=float(hf.get("layernorm_epsilon", 1e-5)),
        rope_theta=10000.0 * float(hf.get("rope_ratio", 1.0)), rope_scaling=None,
        max_position_embeddings=int(hf.get("seq_length", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("add_qkv_bias", False)), o_proj_bias=linear_bias, mlp_bias=linear_bias,
        hidden_act="silu", rotary_dim=head_dim // 2)


def convert(name: str, t, args: ModelArgs):
    if name in RENAMES:
        return ((RENAMES[name], t),)
    if name.endswith("rotary_pos_emb.inv_freq"):
        return ()
    if not name.startswith(LAYERS):
        return ((name, t),)                      # reported as unexpected
    i, rest = layer_index(name, LAYERS)
    prefix = f"model.layers.{i}."
    if rest in LAYER_RENAMES:
        return ((prefix + LAYER_RENAMES[rest], t),)
    suffix = rest.rsplit(".", 1)[-1]
    if rest.startswith("self_attention.query_key_value."):
        return split_qkv(t, args, name, prefix, suffix, interleaved=True)
    if rest.startswith("mlp.dense_h_to_4h."):
        return split_gate_up(t, args, name, prefix, suffix)
    return ((name, t),)


ARCHITECTURES = {"ChatGLMModel": ArchSpec(read_args, convert),
                 "ChatGLMForConditionalGeneration": ArchSpec(read_args, convert)}
