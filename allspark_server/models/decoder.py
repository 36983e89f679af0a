"""The decoder every architecture runs on, as plain PyTorch over the span KV cache: the modules of the layer
description (models/description.py, one tuple of steps per layer, compute/steps.py) and the loop that runs them.

Module names mirror HF's (Llama's, and Gemma 2's extra norms); q/k/v and gate/up are merged projections whose parts
keep HF's names (loader/weights.py concatenates a rank's slices at load time). Tensor parallelism lives in the layers
(column/row-parallel linears, vocab-split LM head); the math here is the single-device math on local head counts.
`SPLIT_RULES` tells the loader how each tensor is sharded. A step with multi-token chunks runs each layer's steps
through these modules; a decode-only step (one new token per sequence) runs the same steps bound to their weights
(compute/step_ops.py): as one native call over all layers (`decode_stack`, native/decode_stack.cpp) when the
extension is built, else layer by layer in Python (the reference ops, or the CUDA backend inside its graphs).
With profiling on (`profiler`, compute/op_profile.py) every step of those loops is timed as one op, and the native
stack times its own ops.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from allspark_server.compute import alibi, ops, row_mode, step_ops
from allspark_server.compute import steps as spec
from allspark_server.compute.op_profile import timed
from allspark_server.layers.attention import PagedAttention
from allspark_server.layers.embedding import Embedding, ParallelLMHead
from allspark_server.layers.experts import SparseMoE
from allspark_server.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from allspark_server.layers.norm import RMSNorm
from allspark_server.layers.rotary import RotaryEmbedding
from allspark_server.layers.sharding import SplitMode, TPLayout
from allspark_server.models.args import ModelArgs
from allspark_server.models.description import describe
from allspark_server.models.registry import get_arch
from allspark_server.step.inputs import ForwardInputs
from allspark_server.step.kv_cache import LayerKV

SPLIT_RULES: list[tuple[str, SplitMode]] = [
    (r"\.mlp\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight$", SplitMode.COLUMN),   # MoE (layers/experts.py)
    (r"\.mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight$", SplitMode.ROW),
    (r"\.self_attn\.q_proj\.(weight|bias)$", SplitMode.HEADS),
    (r"\.self_attn\.[kv]_proj\.(weight|bias)$", SplitMode.KV_HEADS),
    (r"\.self_attn\.o_proj\.weight$", SplitMode.ROW_HEADS),
    (r"\.mlp\.(gate|up)_proj\.(weight|bias)$", SplitMode.COLUMN),
    (r"\.mlp\.down_proj\.weight$", SplitMode.ROW),
    (r"^lm_head\.weight$", SplitMode.VOCAB),
    (r".*", SplitMode.REPLICATE),   # embeddings, norms, row-parallel biases
]
# the GEMM weights InstantQuant may quantize (checkpoint names)
QUANTIZABLE = r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"


class Attention(nn.Module):
    """The Attention step's module: its projections, per-head norms and the attention over the spans."""

    def __init__(self, args: ModelArgs, step: spec.Attention, tp: TPLayout, comm, dtype: torch.dtype):
        super().__init__()
        d = args.head_dim
        self.step = step
        self.num_heads, self.num_kv_heads, self.head_dim = tp.local_heads, tp.local_kv_heads, d
        self.qkv_proj = MergedColumnParallelLinear(
            args.hidden_size, [("q_proj", self.num_heads * d), ("k_proj", self.num_kv_heads * d),
                               ("v_proj", self.num_kv_heads * d)], step.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(self.num_heads * d, args.hidden_size, step.o_bias, dtype, comm)
        # ALiBi models: the slopes of this rank's heads (and no rotary)
        slopes = alibi.local_slopes(args.num_heads, tp.head_range()) if step.position == "alibi" else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, step, slopes)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype) if step.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype) if step.qk_norm else None

    def forward(self, x, inputs: ForwardInputs, rope: tuple[torch.Tensor, torch.Tensor], kv: LayerKV):
        t, lora_rows = x.shape[0], inputs.lora_rows
        q, k, v = self.qkv_proj(x, lora_rows).split(self.qkv_proj.part_sizes, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim))[0]
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim))[0]
        q = q.view(t, self.num_heads, self.head_dim)                       # [T, h, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                    # [T, kvh, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # rotary in one op with the cache write (ALiBi: none, the attention adds the bias)
        o = self.attn(q, k, v, kv, inputs.attn, rope if self.step.position == "rope" else None)     # [T, h*D]
        return self.o_proj(o, lora_rows)                                   # [T, H]

    def bound(self, kv: LayerKV) -> spec.BoundAttention:
        b = spec.BoundAttention(self.step, self.qkv_proj.kernel_weight, self.qkv_proj.bias, self.o_proj.kernel_weight,
                                self.num_heads, self.num_kv_heads, kv.k, kv.v, kv.k_param, kv.v_param,
                                alibi_slopes=self.attn.alibi_slopes, qkv_lora=self.qkv_proj.lora,
                                o_lora=self.o_proj.lora)
        if self.q_norm is not None:     # the per-head norms use the layer's eps
            b.q_norm, b.k_norm, b.norm_eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return b

    def reduce(self, partial):
        return self.o_proj.reduce(partial)

    def reduce_norm(self, partial, residual, norm):
        return self.o_proj.reduce_norm(partial, residual, norm)


class MLP(nn.Module):
    """The Mlp step's module: act(gate) * up through the merged gate|up projection, then down."""

    def __init__(self, args: ModelArgs, step: spec.Mlp, tp: TPLayout, comm, dtype: torch.dtype):
        super().__init__()
        inter = tp.local_intermediate
        self.step = step
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [("gate_proj", inter), ("up_proj", inter)],
                                                       step.bias, dtype)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, step.bias, dtype, comm)

    def forward(self, x, lora_rows=None):   # [T, H] -> [T, H]
        a = ops.act_mul(self.gate_up_proj(x, lora_rows), self.step)             # act(gate) * up: [T, I]
        return self.down_proj(a, lora_rows)

    def bound(self) -> spec.BoundMlp:
        return spec.BoundMlp(self.step, self.gate_up_proj.kernel_weight, self.gate_up_proj.bias,
                             self.down_proj.kernel_weight, gate_up_lora=self.gate_up_proj.lora,
                             down_lora=self.down_proj.lora)

    def reduce(self, partial):
        return self.down_proj.reduce(partial)

    def reduce_norm(self, partial, residual, norm):
        return self.down_proj.reduce_norm(partial, residual, norm)

    @property
    def adds_bias(self) -> bool:     # the reduce adds the down projection's bias
        return self.down_proj.bias is not None


class DecoderLayer(nn.Module):
    """One layer's modules, made from its steps and run in their order."""

    def __init__(self, args: ModelArgs, steps: tuple, tp: TPLayout, comm, dtype: torch.dtype):
        super().__init__()
        self.steps = steps
        for step in steps:
            if isinstance(step, spec.Norm):
                self.add_module(step.name, RMSNorm(args.hidden_size, args.rms_norm_eps, dtype))
            elif isinstance(step, spec.Attention):
                self.self_attn = Attention(args, step, tp, comm, dtype)
            elif isinstance(step, spec.Mlp):
                self.mlp = MLP(args, step, tp, comm, dtype)
            else:
                self.mlp = SparseMoE(args, tp.world_size, dtype, comm)
        # the modules that reduce each sublayer's partial output, in step order (the decode stack's `part`)
        self.sublayers = [self.self_attn if isinstance(s, spec.Attention) else self.mlp
                          for s in steps if not isinstance(s, spec.Norm)]
        self._bound, self._bound_kv = None, None

    def forward(self, x, residual, inputs, ropes: list, kv: LayerKV, prof=None):
        """Takes and returns (x, residual stream); a pre-norm folds the residual add into its single pass. ropes:
        the (cos, sin) rows of each of the model's rotary tables ((None, None) without rotary). `prof`: the
        model's OpProfiler when profiling is on (here each sublayer is one op, its allreduce included)."""
        rope = ropes[self.self_attn.step.rope_table]
        if not inputs.attn.seqs:            # every sequence decodes one token
            return self.decode(x, residual, inputs.attn, rope, kv, prof, inputs.lora_rows)
        for step in self.steps:
            if isinstance(step, spec.Norm):
                norm = getattr(self, step.name)
                x, residual = timed(prof, "norm", _norm, norm, step, x, residual)
            elif isinstance(step, spec.Attention):
                x = timed(prof, "prefill_attention", self.self_attn, x, inputs, rope, kv)
            elif isinstance(step, spec.Mlp):
                x = timed(prof, "prefill_mlp", self.mlp, x, inputs.lora_rows)
            else:
                x = timed(prof, "prefill_mlp", self.mlp, x)
        return x, residual

    def bound(self, kv: LayerKV) -> list:
        """The layer's steps bound to its weights and `kv` (compute/steps.py Bound*), made once per cache."""
        if self._bound_kv is not kv.k:
            out = []
            for step in self.steps:
                if isinstance(step, spec.Norm):
                    norm = getattr(self, step.name)
                    out.append(spec.BoundNorm(step, norm.weight, norm.eps))
                elif isinstance(step, spec.Attention):
                    out.append(self.self_attn.bound(kv))
                else:
                    out.append(self.mlp.bound())
            self._bound, self._bound_kv = out, kv.k
        return self._bound

    def decode(self, x, residual, meta, rope, kv: LayerKV, prof=None, lora_rows=None):
        """The same steps on decode rows, each one op call (compute/step_ops.py). A sublayer's output leaves as a
        PendingSum: its tensor-parallel sum (and row-parallel bias) is taken by the next norm, with it in one launch
        where the comm can, or by whatever comes next (`reduced`); its partial may be a PendingDelta, whose LoRA
        deltas that norm adds (layers/linear.py reduce_into_norm). lora_rows: the rows' LoRA adapters (None:
        none)."""
        sub = iter(self.sublayers)
        for b in self.bound(kv):
            if isinstance(b, spec.BoundNorm):
                if isinstance(x, PendingSum):
                    x, residual = timed(prof, "allreduce_norm", x.sublayer.reduce_norm, x.partial, residual, b)
                else:
                    x, residual = timed(prof, "norm", step_ops.norm_step, x, residual, b)
                continue
            x = reduced(x, prof)
            if isinstance(b, spec.BoundAttention):
                x = timed(prof, "attention_step", step_ops.attention_step, x, b, meta.slot_mapping, meta.decode_spans,
                          meta.decode_ctx, *rope, lora_rows)
            elif isinstance(b, spec.BoundMlp):
                x = timed(prof, "mlp_step", step_ops.mlp_step, x, b, lora_rows)
            else:
                x = timed(prof, "moe", step_ops.moe_step, x, b)
            x = PendingSum(x, next(sub))
        return x, residual


class PendingSum(NamedTuple):
    """A sublayer's decode output before its tensor-parallel sum: `partial`, and the `sublayer` that takes the sum
    (reduce) or the sum and the norm after it (reduce_norm)."""
    partial: torch.Tensor
    sublayer: nn.Module


def reduced(x, prof=None) -> torch.Tensor:
    """x itself, or a PendingSum's sum."""
    if isinstance(x, PendingSum):
        return timed(prof, "allreduce", x.sublayer.reduce, x.partial)
    return x


def _norm(norm: RMSNorm, step: spec.Norm, x, residual):
    """A Norm step's module on (x, residual), as the decode path runs it (compute/step_ops.py norm_step)."""
    return step_ops.norm_step(x, residual, spec.BoundNorm(step, norm.weight, norm.eps))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, model_spec: spec.ModelSpec, tp: TPLayout, comm, dtype: torch.dtype,
                 max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype)
        # the embedding scale as HF applies it, in the activation dtype; a buffer, so it moves with the model (a CUDA
        # graph capture cannot copy a host scalar)
        scale = model_spec.embed_scale
        self.register_buffer("embed_scale", None if scale is None else torch.tensor(scale, dtype=dtype),
                             persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(args, steps, tp, comm, dtype) for steps in model_spec.layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        # the rotary tables the Attention steps' rope_table picks from: the model's, then the sliding layers' own
        # (Gemma 3); ALiBi models have none
        tables = [(args.rope_theta, args.rope_scaling)] + ([(args.local_rope_theta, args.local_rope_scaling)]
                                                             if args.local_rope_theta else [])
        self.rotaries = nn.ModuleList(RotaryEmbedding(args.head_dim, max_positions, theta, scaling, args.rotary_dim,
                                                      args.mrope_section)
                                      for theta, scaling in tables) if args.position_embedding == "rope" else None

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        """Each table's (cos, sin) rows [T, 1, D] of `positions` ([(None, None)] without rotary)."""
        if self.rotaries is None:
            return [(None, None)]
        return [r.cos_sin(positions, dtype) for r in self.rotaries]


class DecoderForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPLayout, comm, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.spec = describe(args)                  # refuses what no step can express, by name
        exact = args.exact_context()
        if exact is not None and max_positions > exact[0]:
            raise ValueError(f"max_length {max_positions} is past this model's context ({exact[0]} tokens), where "
                             f"{exact[1]}: set max_length <= {exact[0]}")
        self.args = args
        self.comm = comm
        self.model = DecoderModel(args, self.spec, tp, comm, dtype, max_positions)
        self.lm_head = ParallelLMHead(tp.local_vocab, args.hidden_size, dtype, comm)
        self._stack, self._stack_cache, self._reduce = None, None, None
        self.lora_generation = 0    # bumped when an adapter is loaded or unloaded: the native stack is built again
        self.profiler = None        # an OpProfiler while profiling is on (set by the runner once its graphs exist)

    def decode_stack(self, kv_cache):
        """The native DecodeStack (a whole decode-only step in one call) over this model's bound steps and
        `kv_cache`: built on first use, None without the native build. Weights and cache pages stay where
        they are once loaded, so it is built once (and again when LoRA adapters come or go)."""
        cached = self._stack_cache
        if cached is None or cached[0] is not kv_cache or cached[1] != self.lora_generation:
            self._stack = timed(self.profiler, "build_decode_stack", self._build_decode_stack, kv_cache)
            self._stack_cache = (kv_cache, self.lora_generation)
        return self._stack

    def _build_decode_stack(self, kv_cache):
        layers, embedding = self.model.layers, self.model.embed_tokens.weight
        if (any(w.dtype != embedding.dtype for w in self.parameters())
                or (self.lm_head.quant is None and not self.lm_head.weight.is_contiguous())):
            return None
        tables = [(r.cos, r.sin) for r in self.model.rotaries] if self.model.rotaries is not None else []
        final = spec.BoundNorm(self.spec.final_norm, self.model.norm.weight, self.model.norm.eps)
        stack = step_ops.decode_stack([layer.bound(kv) for layer, kv in zip(layers, kv_cache.layers)], final,
                                      embedding, tables, self.lm_head.kernel_weight, self.spec.embed_scale)
        # the row-parallel sums: nothing to do at world size 1 without biases, so the stack never calls back
        needs_reduce = self.comm.world_size > 1 or any(
            layer.self_attn.o_proj.bias is not None or layer.mlp.adds_bias for layer in layers)
        self._reduce = self._reduce_partial if needs_reduce else None
        if stack is not None and self.profiler is not None and self.profiler.native is not None:
            stack.set_profile(self.profiler.native)
        return stack

    def _reduce_partial(self, partial: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        return self.model.layers[layer].sublayers[part].reduce(partial)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows, times the model's embed_scale in their dtype where it has one (HF Gemma's)."""
        x = self.model.embed_tokens(ids)                                    # [T, H]
        return x if self.model.embed_scale is None else x * self.model.embed_scale

    def capped(self, logits):
        """The final logits soft-capped where the model caps them (Gemma 2); rank 0's fp32 [N, V] or None."""
        cap = self.spec.final_softcap
        return logits if logits is None or not cap else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, kv_cache):
        """Run all scheduled tokens; return fp32 logits [N, V] of the sample rows (rank 0). With extra rows
        (`inputs.has_extra_rows`): (logits [N + P, V] of the sample rows then the logit rows, final-norm hidden
        states [E, H] of the hidden rows), on every rank (the logits None but on rank 0)."""
        meta, prof = inputs.attn, self.profiler
        # every sequence decodes one token and every row is sampled: the whole step is one native call
        if (not meta.seqs and len(inputs.sample_request_ids) == inputs.input_ids.shape[0]
                and not inputs.has_extra_rows and inputs.embed_rows is None and inputs.rope_positions is None
                and (stack := self.decode_stack(kv_cache)) is not None):
            # alone-rows mode (a verify step): every row on the GEMV, as a one-row step computes it (row_mode.py)
            verify = {"all_rows_native": True} if row_mode.alone() else {}
            lora = {"lora_slots": inputs.lora_rows.slots} if inputs.lora_rows is not None else {}
            local = stack.run(inputs.input_ids, inputs.positions, meta.slot_mapping, meta.decode_spans,
                              meta.decode_ctx, self._reduce, **verify, **lora)
            return self.capped(timed(prof, "lm_head_gather", self.lm_head.gather, local))
        x = timed(prof, "embedding", self.embed, inputs.input_ids)         # [T, H]
        if inputs.embed_rows is not None:                                   # image tokens: the images' embeddings
            x[inputs.embed_rows] = inputs.embed_values.to(x.dtype)
        rope_positions = inputs.positions if inputs.rope_positions is None else inputs.rope_positions
        ropes = timed(prof, "rope_rows", self.model.ropes, rope_positions, x.dtype)   # per table: [T, 1, D] x 2
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, inputs, ropes, kv_cache.layers[i], prof)
        x = reduced(x, prof)
        rows = inputs.sample_rows
        if inputs.has_extra_rows:   # prompt logprobs' rows after the sampled ones, then embeddings' rows
            rows = torch.cat([r for r in (rows, inputs.logit_rows, inputs.hidden_rows) if r is not None])
        h, _ = timed(prof, "final_norm", _norm, self.model.norm, self.spec.final_norm, x[rows],
                     residual[rows])                                        # [N (+ P + E), H]
        if not inputs.has_extra_rows:
            return self.capped(timed(prof, "lm_head", self.lm_head, h))   # [N, V] on rank 0
        n = rows.shape[0] - len(inputs.hidden_request_ids)
        return self.capped(timed(prof, "lm_head", self.lm_head, h[:n])), h[n:]   # [N + P, V], [E, H]


def model_class_and_rules(architecture: str):
    """The decoder class every architecture runs on, and how its tensors are sharded (checked by name first)."""
    get_arch(architecture)
    return DecoderForCausalLM, SPLIT_RULES


def quantizable_weights(architecture: str) -> str:
    """The regex of the (canonical) weights InstantQuant may quantize: the decoder's GEMMs."""
    get_arch(architecture)
    return QUANTIZABLE
