"""The layer description's vocabulary: the kinds of step a decoder layer is made of, with their options.

An architecture's decoder layer is a tuple of these steps (models/description.py builds it from ModelArgs), and
every backend runs that same tuple: the reference and CUDA paths step by step (models/decoder.py through
compute/ops.py), the native CPU path as one descriptor struct per step (native/steps.h) inside its one-call decode
stack. Steps apply in order to the pair (x, residual); their sum is HF's hidden state:
  Norm       x = rmsnorm(x) * w. adds_residual: the pre-norm form, s = x * residual_scale + residual is normed
             and becomes the residual stream; otherwise a sandwich norm of a sublayer's (already summed) output.
  Attention  x = o_proj(attend(rotate(qkv_proj(x)))), summed over the ranks (a row-parallel o_proj).
  Mlp        x = down_proj(act(gate_proj(x)) * up_proj(x)), summed over the ranks.
  Moe        x = the router's top-k experts' Mlps, weighted (plus a gated shared expert), summed over the ranks.
A new layer feature is an option or a step kind here, its reference op (compute/reference.py) and at most one kernel
per backend. The Bound* classes are a step with the tensors one layer runs it on: what compute/step_ops.py runs.
The native descriptors (native/steps.h) are filled from these fields by name (compute/step_binding.py, checked when
the extension loads): an option the native path does not read itself is named in its class's NOT_NATIVE, with
what carries it instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch

from allspark_server.compute.lora_slots import LoraSlots

ACTIVATIONS = ("silu", "gelu_tanh")     # Mlp.act; the native MlpStep's `activation` is the index
Weight = Any                            # a dense torch.Tensor or a quant.formats.QuantizedWeight


@dataclass(frozen=True)
class Norm:
    name: str                   # the norm's module in the layer (HF's name, e.g. input_layernorm)
    adds_residual: bool = True
    residual_scale: float = 1.0     # a pre-norm adds x * this (in x's dtype) to the residual stream (Granite)

    NOT_NATIVE: ClassVar[dict] = {"name": "the module the weight comes from"}


@dataclass(frozen=True)
class Attention:
    scale: float                # of q.k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False       # RMSNorm over each head of q and k before the rotary (Qwen3)
    position: str = "rope"      # "rope" (the model's rotary tables) or "alibi" (a per-head score bias, no rotary)
    softcap: float = 0.0        # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2); 0: none
    window: int = 0             # sliding window: a query sees the last `window` positions, itself included; 0: all
    rope_table: int = 0         # which of the model's rotary tables rotates q and k (Gemma 3's local layers: 1)

    NOT_NATIVE: ClassVar[dict] = {"qkv_bias": "the bound qkv_bias tensor", "qk_norm": "the bound q_norm / k_norm",
                                  "o_bias": "the row-parallel reduce after the step",
                                  "position": "rotary, alibi_slopes"}

    @property
    def rotary(self) -> bool:
        return self.position == "rope"


@dataclass(frozen=True)
class Mlp:
    act: str = "silu"           # one of ACTIVATIONS
    bias: bool = False

    NOT_NATIVE: ClassVar[dict] = {"act": "activation", "bias": "gate_up_bias; the down bias in the reduce"}

    @property
    def activation(self) -> int:
        return ACTIVATIONS.index(self.act)


@dataclass(frozen=True)
class Moe:
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert: bool = False

    NOT_NATIVE: ClassVar[dict] = {"num_experts": "the experts' weight lists", "shared_expert": "shared_gate_up"}


Step = Union[Norm, Attention, Mlp, Moe]


@dataclass(frozen=True)
class ModelSpec:
    """The whole stack: every layer's steps, and what the model does around them."""
    layers: tuple[tuple[Step, ...], ...]
    final_norm: Norm = Norm("norm")         # after the last layer (it adds the last sublayer's output first)
    embed_scale: Optional[float] = None     # the embedding rows times this, in the activation dtype (Gemma)
    final_softcap: float = 0.0              # logits -> cap * tanh(logits / cap) (Gemma 2); 0: none


# ---- a step bound to one layer's tensors (weights dense or quant.formats.QuantizedWeight) ----------------------

@dataclass
class BoundNorm:
    step: Norm
    weight: torch.Tensor
    eps: float
    native: Any = field(default=None, repr=False)   # its native descriptor (native/steps.h), made once


@dataclass
class BoundAttention:
    step: Attention
    qkv: Weight
    qkv_bias: Optional[torch.Tensor]
    o: Weight
    num_heads: int                          # this rank's
    num_kv_heads: int
    k_cache: torch.Tensor                   # the layer's KV cache (step/kv_cache.py LayerKV)
    v_cache: torch.Tensor
    k_param: Optional[torch.Tensor] = None
    v_param: Optional[torch.Tensor] = None
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    norm_eps: float = 1e-6
    alibi_slopes: Optional[torch.Tensor] = None    # fp32 [num_heads], this rank's heads
    qkv_lora: Optional[LoraSlots] = None            # the projections' LoRA adapters (compute/lora_slots.py)
    o_lora: Optional[LoraSlots] = None
    native: Any = field(default=None, repr=False)

    @property
    def lora_version(self) -> tuple:
        return lora_versions(self.qkv_lora, self.o_lora)


@dataclass
class BoundMlp:
    step: Mlp
    gate_up: Weight
    gate_up_bias: Optional[torch.Tensor]
    down: Weight
    gate_up_lora: Optional[LoraSlots] = None
    down_lora: Optional[LoraSlots] = None
    native: Any = field(default=None, repr=False)

    @property
    def lora_version(self) -> tuple:
        return lora_versions(self.gate_up_lora, self.down_lora)


@dataclass
class BoundMoe:
    step: Moe
    router: torch.Tensor
    experts: list                           # [(gate_up, down)] per expert
    shared: Optional[tuple] = None          # (gate_up, down) of the shared expert
    shared_gate: Optional[torch.Tensor] = None
    native: Any = field(default=None, repr=False)

    @property
    def gate_up(self) -> list[Weight]:
        return [g for g, _ in self.experts]

    @property
    def down(self) -> list[Weight]:
        return [d for _, d in self.experts]

    @property
    def shared_gate_up(self) -> Optional[Weight]:
        return self.shared[0] if self.shared else None

    @property
    def shared_down(self) -> Optional[Weight]:
        return self.shared[1] if self.shared else None


Bound = Union[BoundNorm, BoundAttention, BoundMlp, BoundMoe]


def lora_versions(*loras: Optional[LoraSlots]) -> tuple:
    """What a native descriptor built from these adapters depends on: it is rebuilt when this changes."""
    return tuple(None if lora is None else lora.version for lora in loras)
