"""Multi-adapter LoRA for eager steps of many rows (prompt and mixed steps): every slot's shrink as one GEMM, kept
on each row only for its own slot, and every slot's expand as one GEMM that adds into the projection's output.

    t = x @ A_flat.T             A_flat [S*R, K], the slots' A stacked: [T, S*R], rounded to x's dtype
    t[other slots] = 0           per row, every slot's ranks but its own's (an overflow there too)
    y = round(y + t @ B_flat.T)  B_flat [N, S*R], the slots' B side by side (torch.addmm, beta 1)

An eager step is bound by the host's launches, not by the GPU: these are three torch launches where
lora_grouped's are two Triton launches, each several times a torch launch's host time, plus their buffers and
counters. The GEMMs do S times the products a row needs, which cuBLAS's rate makes cheap at the ranks adapters
have; rows without an adapter get exact zeros. The sums are cuBLAS's (a row's bits may vary with the batch, as
the base GEMM's do); CUDA graphs keep lora_grouped, whose kernels need no host work at replay.
"""
from __future__ import annotations

import torch

from allspark_server.compute.lora_slots import LoraRows, LoraSlots


def dense_lora_add_(y: torch.Tensor, x: torch.Tensor, lora: LoraSlots, rows: LoraRows) -> torch.Tensor:
    """y [T, N] += each row's B[slot] . (A[slot] . x), in place (x [T, K]); returns y."""
    a_stack, b_stack = lora.stacked()                               # [S, R, K], [S, N, R]
    n_slots, rank, k = a_stack.shape
    t = torch.nn.functional.linear(x, a_stack.view(n_slots * rank, k))                  # [T, S*R]
    t.view(-1, n_slots, rank).masked_fill_(rows.other_slots(n_slots).unsqueeze(-1), 0)
    return y.addmm_(t, lora.derived("b_flat", _flat_b).t())


def _flat_b(lora: LoraSlots) -> torch.Tensor:
    """[N, S*R]: the slots' B side by side, slot-major columns (the stack's [S, N, R] is no view of it)."""
    b_stack = lora.stacked()[1]
    return b_stack.permute(1, 0, 2).reshape(b_stack.shape[1], -1).contiguous()
