"""Token embedding (replicated on every rank) and the LM head (split by vocabulary, gathered to rank 0)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from allspark_server.compute import ops
from allspark_server.layers.linear import ParallelLinear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, H]
        return F.embedding(ids, self.weight)


class ParallelLMHead(ParallelLinear):
    """logits = h @ W^T with W split by vocab rows (dense, or quantized with quantize_lm_head); rank 0 receives
    the full fp32 logits."""

    def __init__(self, vocab_size_local: int, hidden_size: int, dtype: torch.dtype, comm):
        super().__init__(hidden_size, vocab_size_local, False, dtype)
        self.comm = comm

    def forward(self, h: torch.Tensor) -> Optional[torch.Tensor]:   # [N, H] -> [N, V] fp32 on rank 0
        return self.gather(ops.linear(h, self.kernel_weight).float())   # [N, V_local] on each rank

    def gather(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's fp32 [N, V_local] logits -> the full [N, V] on rank 0 (None elsewhere)."""
        return self.comm.gather_rows(local)
