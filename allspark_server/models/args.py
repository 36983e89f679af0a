"""ModelArgs: what every architecture's config.json is read into (models/<arch>.py), and what the layer description
(models/description.py), the decoder and the loader are built from.

Handles both spellings of rope settings (`rope_scaling` + top-level `rope_theta` in older configs,
`rope_parameters` in newer ones). Frozen and JSON-serializable so it can travel in the .asgraph; fields added
later have defaults, so older model files still read.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v bias
    o_proj_bias: bool
    mlp_bias: bool
    hidden_act: str
    qk_norm: bool = False        # Qwen3: RMSNorm over each head of q and k (weights [head_dim]) before the rotary
    rotary_dim: int = 0          # dims of each head that rotate (0: all); our layout puts rotating pair i at dims
                                 # (i, i + head_dim/2), the converters reorder checkpoints that pair them otherwise
    # M-RoPE (Qwen2-VL): the rotating pairs split into sections (temporal, height, width: pair counts summing to
    # rotary_dim/2), each rotated by its own component of a token's 3-D position (layers/rotary.py); () = 1-D rope
    mrope_section: tuple = ()
    lm_head_normalized: bool = False   # Baichuan2's NormHead: the head's rows were normalized when loaded
    position_embedding: str = "rope"   # "rope", or "alibi" (Baichuan2-13B: a per-head score bias, compute/alibi.py,
                                       # and no rotary)
    # mixture of experts (layers/experts.py): the layers in moe_layers route each token to num_experts_per_tok of
    # num_experts experts (softmax over the router's logits, the top k, renormalized when norm_topk_prob), plus a
    # shared expert behind a sigmoid gate when shared_expert_intermediate_size (Qwen2-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple = ()
    # Gemma 2 (models/gemma.py): norms around each sublayer's output too ("sandwich"), the embedding rows scaled by
    # embed_scale, q.k scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, attention scores and
    # final logits soft-capped (0: not), and a sliding window of `sliding_window` positions on sliding_layers
    sandwich_norms: bool = False
    embed_scale: float = 0.0
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    sliding_window: int = 0
    sliding_layers: tuple = ()
    # Gemma 3: the sliding layers rotate with their own base (and scaling); 0: as every other layer
    local_rope_theta: float = 0.0
    local_rope_scaling: Optional[dict] = None
    # tokens up to which the model is exact when something we do not implement acts past them (Qwen v1's dynamic
    # NTK and logn attention past seq_length), 0: none; the reason goes into the error of a longer max_length
    context_limit: int = 0
    context_limit_reason: str = ""
    # values only the family's own module reads (its ArchSpec's refine and convert, models/registry.py), from
    # config.json: a new family's scalars go here, not into a field every other family carries; JSON values
    options: dict = field(default_factory=dict)

    def exact_context(self) -> Optional[tuple[int, str]]:
        """(tokens, why) when this model may serve only up to a length: dynamic NTK rope or context_limit."""
        from allspark_server.layers.rotary import dynamic_rope_limit
        limit = dynamic_rope_limit(self.rope_scaling, self.max_position_embeddings)
        if limit is not None:
            return limit, ("its dynamic NTK rope would change every frequency as a sequence grows (keys in the KV "
                           "cache cannot follow)")
        return (self.context_limit, self.context_limit_reason) if self.context_limit else None

    @property
    def num_rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"the model file's args have fields this allspark does not know ({', '.join(unknown)}): "
                             "it was written by another version; serialize the model again")
        return cls(**d)


def rope_settings(hf: dict) -> tuple[float, Optional[dict]]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
        scaling["rope_type"] = rope_type
        from allspark_server.layers.rotary import SUPPORTED_ROPE_TYPES
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} (config.json's rope_scaling / rope_parameters) is not "
                             f"supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "default":
            scaling = None
    return theta, scaling


def args_from_hf_config(hf: dict, qkv_bias_always: bool, **extra) -> ModelArgs:
    """The Llama-style keys. Llama: `attention_bias` sets q/k/v/o biases. Qwen2: q/k/v always biased, o_proj
    never. `extra`: fields the architecture sets itself."""
    llama_bias = bool(hf.get("attention_bias", False))
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = rope_settings(hf)
    return ModelArgs(
        architecture=hf["architectures"][0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias_always or llama_bias,
        o_proj_bias=llama_bias and not qkv_bias_always,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=str(hf.get("hidden_act", "silu")),
        **extra,
    )
