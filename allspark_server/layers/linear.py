"""Linear layers for tensor parallelism: replicated, column-parallel (output split) and row-parallel
(input split, followed by one allreduce). Weights are [out, in] as in HF; each rank holds its shard,
already sliced by the loader. At world size 1 these are plain linears.
"""
from __future__ import annotations

import torch
from torch import nn

from allspark_server import ops


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local); output features split across ranks."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features_local, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features_local, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out_local]
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = allreduce(x_local @ W_local^T) (+ b); input features split across ranks."""

    def __init__(self, in_features_local: int, out_features: int, bias: bool, dtype: torch.dtype, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in_local] -> [T, out]
        return self.reduce(ops.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x_local @ W_local^T (+ b): for callers that computed their partial product
        themselves (the fused decode blocks)."""
        self.comm.allreduce_(partial)
        if self.bias is not None:
            partial = partial + self.bias
        return partial


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
