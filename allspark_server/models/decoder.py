"""The decoder every architecture runs on (DESIGN §9: the layer sequence is written once), as plain PyTorch over
the span KV cache. What differs between architectures is read from ModelArgs: q/k/v and o biases, q/k norms
(Qwen3), full or partial rotary; the architecture files (models/<arch>.py) map their checkpoints onto these names.

Module names mirror HF Llama's; q/k/v and gate/up are merged projections whose parts keep HF's names
(loader/weights.py concatenates a rank's slices at load time). Tensor parallelism
lives in the layers (column/row-parallel linears, vocab-split LM head); the math here is the
single-device math on local head counts. `SPLIT_RULES` tells the loader how each tensor is sharded.
A decode-only step (one new token per sequence) runs as a single native call over all layers
(`decode_stack`, native/decode_stack.cpp) when the extension is built; `DecoderLayer.decode` is the same
math per layer in Python, used without it.
"""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.compute import ops
from allspark_server.compute import alibi
from allspark_server.layers.attention import PagedAttention
from allspark_server.layers.embedding import Embedding, ParallelLMHead
from allspark_server.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from allspark_server.layers.moe import SparseMoE
from allspark_server.layers.norm import RMSNorm
from allspark_server.layers.rotary import RotaryEmbedding
from allspark_server.layers.sharding import SplitMode, TPLayout
from allspark_server.models.args import ModelArgs
from allspark_server.step.inputs import ForwardInputs
from allspark_server.step.kv_cache import LayerKV

SPLIT_RULES: list[tuple[str, SplitMode]] = [
    (r"\.mlp\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight$", SplitMode.COLUMN),   # MoE (layers/moe.py)
    (r"\.mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight$", SplitMode.ROW),
    (r"\.self_attn\.q_proj\.(weight|bias)$", SplitMode.HEADS),
    (r"\.self_attn\.[kv]_proj\.(weight|bias)$", SplitMode.KV_HEADS),
    (r"\.self_attn\.o_proj\.weight$", SplitMode.ROW),
    (r"\.mlp\.(gate|up)_proj\.(weight|bias)$", SplitMode.COLUMN),
    (r"\.mlp\.down_proj\.weight$", SplitMode.ROW),
    (r"^lm_head\.weight$", SplitMode.VOCAB),
    (r".*", SplitMode.REPLICATE),   # embeddings, norms, row-parallel biases
]
# the GEMM weights InstantQuant may quantize (checkpoint names)
QUANTIZABLE = r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype):
        super().__init__()
        d = args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = tp.local_heads, tp.local_kv_heads, d
        self.qkv_proj = MergedColumnParallelLinear(
            args.hidden_size, [("q_proj", self.num_heads * d), ("k_proj", self.num_kv_heads * d),
                               ("v_proj", self.num_kv_heads * d)], args.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.num_heads * d, args.hidden_size, args.o_proj_bias, dtype, comm)
        # ALiBi models: the slopes of this rank's heads (and no rotary)
        slopes = (alibi.local_slopes(args.num_heads, tp.rank, tp.local_heads)
                  if args.position_embedding == "alibi" else None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, slopes)
        # Qwen3: RMSNorm over each head's q and k, before the rotary
        self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype) if args.qk_norm else None

    def forward(self, x, inputs: ForwardInputs, rope: tuple[torch.Tensor, torch.Tensor], kv: LayerKV):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.part_sizes, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim))[0]
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim))[0]
        q = q.view(t, self.num_heads, self.head_dim)                       # [T, h, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                    # [T, kvh, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.attn.alibi_slopes is None:                                 # ALiBi: the attention adds the bias
            q, k = ops.rotary(q, k, *rope)
        o = self.attn(q, k, v, kv, inputs.attn)                            # [T, h*D]
        return self.o_proj(o)                                              # [T, H]

    def qk_norm_weights(self) -> tuple:
        """(q_norm weight, k_norm weight) for the fused decode calls, () without q/k norms."""
        return () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype):
        super().__init__()
        inter = tp.local_intermediate
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [("gate_proj", inter), ("up_proj", inter)],
                                                       args.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, args.mlp_bias, dtype, comm)

    def forward(self, x):   # [T, H] -> [T, H]
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))          # silu(gate) * up: [T, I]

    def decode_block(self, x, residual, norm: RMSNorm):
        """norm(x + residual) and this MLP in one call: (partial output before the allreduce, x + residual)."""
        return ops.decode_mlp_block(x, residual, norm.weight, norm.eps, self.gate_up_proj.kernel_weight,
                                    self.gate_up_proj.bias, self.down_proj.kernel_weight)

    def reduce(self, partial):
        return self.down_proj.reduce(partial)

    @property
    def adds_bias(self) -> bool:     # the reduce adds the down projection's bias
        return self.down_proj.bias is not None


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = Attention(args, tp, comm, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        # a dense MLP or a mixture of experts: both give decode_block / reduce
        self.mlp = (SparseMoE(args, tp.world_size, dtype, comm) if index in args.moe_layers
                    else MLP(args, tp, comm, dtype))

    def forward(self, x, residual, inputs, rope, kv: LayerKV):
        """HF's `x + attn(norm(x))`, `x + mlp(norm(x))` with each add done inside the next norm:
        takes and returns (sublayer output, residual stream); their sum is HF's hidden state."""
        if not inputs.attn.seqs:            # every sequence decodes one token
            return self.decode(x, residual, inputs.attn, rope, kv)
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, inputs, rope, kv)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def decode(self, x, residual, meta, rope, kv: LayerKV):
        """The same math as forward, each half of the layer one fused call (ops.decode_*_block); only
        the tensor-parallel allreduces (and row-parallel biases) run between them."""
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        o, residual = ops.decode_attention_block(
            x, residual, norm1.weight, norm1.eps, attn.qkv_proj.kernel_weight, attn.qkv_proj.bias, attn.num_heads,
            attn.num_kv_heads, *rope, kv.k, kv.v, meta.slot_mapping, meta.decode_spans, meta.decode_ctx,
            attn.attn.scale, attn.o_proj.kernel_weight, kv.k_param, kv.v_param, *attn.qk_norm_weights(),
            alibi_slopes=attn.attn.alibi_slopes)
        h, residual = mlp.decode_block(attn.o_proj.reduce(o), residual, norm2)
        return mlp.reduce(h), residual


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(args, tp, comm, dtype, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary = (RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling,
                                       args.rotary_dim) if args.position_embedding == "rope" else None)   # ALiBi: none


class DecoderForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype, max_positions: int):
        super().__init__()
        if args.hidden_act != "silu":
            raise ValueError(f"hidden_act {args.hidden_act!r} is not supported (only silu)")
        if args.position_embedding not in ("rope", "alibi"):
            raise ValueError(f"position_embedding {args.position_embedding!r} is not supported (rope, alibi)")
        exact = args.exact_context()
        if exact is not None and max_positions > exact[0]:
            raise ValueError(f"max_length {max_positions} is past this model's context ({exact[0]} tokens), where "
                             f"{exact[1]}: set max_length <= {exact[0]}")
        self.args = args
        self.comm = comm
        self.model = DecoderModel(args, tp, comm, dtype, max_positions)
        self.lm_head = ParallelLMHead(tp.local_vocab, args.hidden_size, dtype, comm)
        self._stack, self._stack_cache, self._reduce = None, None, None

    def decode_stack(self, kv_cache):
        """The native DecodeStack (a whole decode-only step in one call) over this model's weights and
        `kv_cache`: built on first use, None without the native build. Weights and cache pages stay where
        they are once loaded, so it is built once."""
        if self._stack_cache is not kv_cache:
            self._stack, self._stack_cache = self._build_decode_stack(kv_cache), kv_cache
        return self._stack

    def _build_decode_stack(self, kv_cache):
        layers = self.model.layers
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        dtype = self.model.embed_tokens.weight.dtype
        if (any(w.dtype != dtype for w in self.parameters())
                or self.model.norm.eps != norm.eps
                or (self.lm_head.quant is None and not self.lm_head.weight.is_contiguous())):
            return None
        stack = ops.decode_stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.attn.scale,
                                 dtype, self.model.embed_tokens.weight.device, attn.attn.alibi_slopes)
        if stack is None:
            return None
        for layer, kv in zip(layers, kv_cache.layers):
            a, m = layer.self_attn, layer.mlp
            assert layer.input_layernorm.eps == layer.post_attention_layernorm.eps == norm.eps
            w = ops.native_weight
            dense = (w(m.gate_up_proj.kernel_weight), m.gate_up_proj.bias, w(m.down_proj.kernel_weight)) \
                if isinstance(m, MLP) else (None, None, None)
            stack.add_layer(layer.input_layernorm.weight, w(a.qkv_proj.kernel_weight), a.qkv_proj.bias,
                            w(a.o_proj.kernel_weight), layer.post_attention_layernorm.weight, *dense,
                            *kv, *a.qk_norm_weights())
            if isinstance(m, SparseMoE):               # the layer's MLP half: its experts (native/moe.cpp)
                b = m.block_weights()
                stack.set_moe(b["router"], [w(g) for g, _ in b["experts"]], [w(d) for _, d in b["experts"]],
                              b["top_k"], b["norm_topk_prob"], *(map(w, b["shared"]) if b["shared"] else (None, None)),
                              b["shared_gate"])
        rotary = self.model.rotary                                          # None: ALiBi, no tables
        cos_sin = (rotary.cos, rotary.sin) if rotary is not None else (None, None)
        stack.set_ends(self.model.embed_tokens.weight, *cos_sin, self.model.norm.weight,
                       ops.native_weight(self.lm_head.kernel_weight))
        # the row-parallel sums: nothing to do at world size 1 without biases, so the stack never calls back
        if self.comm.world_size == 1 and all(layer.self_attn.o_proj.bias is None and not layer.mlp.adds_bias
                                             for layer in layers):
            self._reduce = None
        else:
            self._reduce = self._reduce_partial
        return stack

    def _reduce_partial(self, partial: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        sub = self.model.layers[layer]
        return (sub.self_attn.o_proj if part == 0 else sub.mlp).reduce(partial)

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, kv_cache) -> torch.Tensor:
        """Run all scheduled tokens; return fp32 logits [N, V] of the sample rows (rank 0)."""
        meta = inputs.attn
        # every sequence decodes one token and every row is sampled: the whole step is one native call
        if (not meta.seqs and len(inputs.sample_request_ids) == inputs.input_ids.shape[0]
                and (stack := self.decode_stack(kv_cache)) is not None):
            local = stack.run(inputs.input_ids, inputs.positions, meta.slot_mapping, meta.decode_spans,
                              meta.decode_ctx, self._reduce)
            return self.lm_head.gather(local)
        x = self.model.embed_tokens(inputs.input_ids)                       # [T, H]
        rotary = self.model.rotary                                          # None: ALiBi, no rotary
        rope = rotary.cos_sin(inputs.positions, x.dtype) if rotary is not None else (None, None)   # [T, 1, D] x 2
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, inputs, rope, kv_cache.layers[i])
        rows = inputs.sample_rows
        h, _ = self.model.norm(x[rows], residual[rows])                     # [N, H]
        return self.lm_head(h)                                              # [N, V] on rank 0
