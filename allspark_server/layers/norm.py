"""RMSNorm computed in fp32 and cast back, the way HF Llama/Qwen2 do it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, H]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)   # one fused op, in fp32
        return self.weight * normed.to(x.dtype)
