"""RMSNorm with the residual add folded in (ops.rms_norm): computed in fp32 and cast back, the way
HF Llama/Qwen2 do it. `norm(x, residual)` returns (normed, x + residual): the decoder keeps the
residual stream separate so each add happens inside the next norm's single pass."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from allspark_server.compute import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, H] -> (weight * rmsnorm(x + residual), x + residual); no residual: (.., x)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
