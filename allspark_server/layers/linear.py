"""Linear layers for tensor parallelism: replicated, column-parallel (output split) and row-parallel
(input split, followed by one allreduce). Weights are [out, in] as in HF; each rank holds its shard,
already sliced by the loader. At world size 1 these are plain linears.

A layer's weight is dense (`weight`) or, after `quantize_`, InstantQuant buffers (`qweight`, `scales`,
`zeros` or, for uint4_min, `mins`; quant/formats.py has the layout); `kernel_weight` is what the ops take either way.
A layer may carry LoRA adapters (`lora`, compute/lora_slots.py: this rank's A and B by slot); the rows of a step
that use one gain its delta, a row-parallel layer's before the allreduce (its A is split by input like the weight).
A row-parallel layer's sum can be taken together with the norm after it (`reduce_norm`), in one launch where the
comm has one (the GPU ranks' peer-memory allreduce).
"""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.compute import ops, step_ops
from allspark_server.compute.lora_slots import LoraRows, LoraSlots
from allspark_server.compute.pending_delta import PendingDelta, resolved
from allspark_server.compute.steps import BoundNorm
from allspark_server.quant.formats import QuantizedWeight, bits, group_count, has_mins, is_asymmetric, is_float


class ParallelLinear(nn.Module):
    """The weight [out, in] of this rank and an optional bias [out]; dense until `quantize_`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.quant: tuple[str, int, int] | None = None      # (format, group size, act_bits) once quantized
        self.lora: LoraSlots | None = None                   # LoRA adapters, once the model may load them

    def quantize_(self, fmt: str, group_size: int, act_bits: int = 16) -> None:
        """Replace the dense weight by empty quantized buffers of this rank's shape (the loader fills them);
        act_bits: how x is rounded before it meets the codes (QuantizedWeight)."""
        del self.weight
        n, k = self.out_features, self.in_features
        code_dtype = torch.int8 if fmt == "int8" else torch.uint8
        self.register_buffer("qweight", torch.empty(n, k // 2 if bits(fmt) == 4 else k, dtype=code_dtype))
        groups = group_count(k, group_size)
        scale_dtype = torch.float32 if is_float(fmt) else torch.float16
        self.register_buffer("scales", torch.empty(n, groups, dtype=scale_dtype))
        self.register_buffer("zeros", torch.empty(n, groups, dtype=torch.uint8)
                             if is_asymmetric(fmt) and not has_mins(fmt) else None)
        self.register_buffer("mins", torch.empty(n, groups, dtype=torch.float16) if has_mins(fmt) else None)
        self.quant = (fmt, group_size, act_bits)

    @property
    def kernel_weight(self) -> "torch.Tensor | QuantizedWeight":
        if self.quant is None:
            return self.weight
        fmt, group_size, act_bits = self.quant
        offsets = self.mins if has_mins(fmt) else self.zeros     # QuantizedWeight's group offsets
        return QuantizedWeight(self.qweight, self.scales, offsets, fmt, group_size, self.in_features, act_bits)


class ColumnParallelLinear(ParallelLinear):
    """y_local = x @ W_local^T (+ b_local); output features split across ranks."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, out_features_local, bias, dtype)

    def forward(self, x: torch.Tensor, lora_rows: LoraRows | None = None) -> torch.Tensor:   # [T, in] -> [T, out_local]
        return ops.lora_linear(x, self.kernel_weight, self.bias, self.lora, lora_rows)


class RowParallelLinear(ParallelLinear):
    """y = allreduce(x_local @ W_local^T) (+ b); input features split across ranks."""

    def __init__(self, in_features_local: int, out_features: int, bias: bool, dtype: torch.dtype, comm):
        super().__init__(in_features_local, out_features, bias, dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor, lora_rows: LoraRows | None = None) -> torch.Tensor:   # [T, in_local] -> [T, out]
        return self.reduce(ops.lora_linear(x, self.kernel_weight, None, self.lora, lora_rows))

    def reduce(self, partial) -> torch.Tensor:
        """The sum over ranks of x_local @ W_local^T (+ b): for callers that computed their partial product
        themselves (the fused decode blocks; a PendingDelta's deltas added first)."""
        partial = resolved(partial)
        self.comm.allreduce_(partial)
        if self.bias is not None:
            partial = partial + self.bias
        return partial

    def reduce_norm(self, partial: torch.Tensor, residual, norm: BoundNorm):
        """norm_step(reduce(partial), residual, norm): (normed, residual stream)."""
        return reduce_into_norm(self.comm, partial, residual, norm, self.reduce, self.bias is None)


def reduce_into_norm(comm, partial, residual, norm: BoundNorm, reduce, plain_sum: bool = True):
    """norm_step(reduce(partial), residual, norm), in one launch where `comm` has one: the reduce a plain sum
    (`plain_sum`: no bias after it) and the norm a plain residual add and RMSNorm. A PendingDelta's deltas are
    added by that norm's launch on one rank, before the sum elsewhere."""
    plain = plain_sum and residual is not None and norm.step.adds_residual and norm.step.residual_scale == 1.0
    if isinstance(partial, PendingDelta):
        if plain and comm.world_size == 1:
            return partial.norm(norm.weight, norm.eps, residual)
        partial = partial.resolved()
    if plain:
        fused = comm.allreduce_norm(partial, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    return step_ops.norm_step(reduce(partial), residual, norm)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (q/k/v, gate/up).

    `parts` names the checkpoint tensors it is made of, in order, with their local output sizes;
    the loader concatenates them (loader/weights.py) and forward returns one [T, sum] tensor.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, sum(size for _, size in parts), bias, dtype)
        self.parts = parts

    @property
    def part_sizes(self) -> list[int]:
        return [size for _, size in self.parts]
