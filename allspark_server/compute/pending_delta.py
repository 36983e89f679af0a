"""A projection's decode output whose LoRA deltas are not added yet. Grouped adapter rows on a GPU compute their
deltas beside the projection's GEMM (compute/cuda/lora_grouped.py), so that no launch of theirs waits for it; the
kernel that reads the output next adds them as it loads it: the residual add and RMSNorm after the o and down
projections (layers/linear.py reduce_into_norm), silu·mul after gate|up (compute/cuda/cuda_ops.py mlp_step).
Whatever else reads the output takes `resolved()`: the same bits as the deltas added in place.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class PendingDelta(NamedTuple):
    y: torch.Tensor         # the projection's output [T, N]
    delta: torch.Tensor     # each row's adapter delta [T, N], fp32 (zeros for rows without an adapter)

    def resolved(self) -> torch.Tensor:
        """y = round(y + delta) in y's dtype, in place: what the expand writes into y itself."""
        from allspark_server.compute.cuda import lora_grouped
        return lora_grouped.add_delta_(self.y, self.delta)

    def norm(self, weight: torch.Tensor, eps: float, residual: torch.Tensor):
        """ops.rms_norm(resolved(), weight, eps, residual) in the norm's one launch: (normed, residual stream)."""
        from allspark_server.compute.cuda import fused_kernels
        return fused_kernels.rms_norm(self.y, weight, eps, residual, delta=self.delta)


def resolved(x):
    """x itself, or a PendingDelta's output with its deltas added."""
    return x.resolved() if isinstance(x, PendingDelta) else x


def output_and_delta(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the output, its pending deltas or None) of a projection's result, a tensor or a PendingDelta."""
    return (x.y, x.delta) if isinstance(x, PendingDelta) else (x, None)
