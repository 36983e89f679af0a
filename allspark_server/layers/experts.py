"""A mixture-of-experts MLP: a router picks each token's top-k experts, each a gated MLP; a shared expert behind
a sigmoid gate (Qwen2-MoE) adds to every token. Tensor parallel as the dense MLP: each expert's intermediate
dimension is split across ranks (gate/up column-, down row-parallel), the router and the shared gate are
replicated, and the sum of all experts' partial products is reduced once per layer.

Routing (HF's for Qwen-MoE and Mixtral): softmax over the router's logits in fp32, the top k, divided by their sum
when norm_topk_prob. Experts run in increasing index order over the rows routed to them (a prefill groups its
tokens by expert); their weighted outputs are summed in fp32. A decode-only step runs it as the layer description's
Moe step (compute/step_ops.moe_step; native: one call reading only the chosen experts' weights).
"""
from __future__ import annotations

import torch
from torch import nn

from allspark_server.compute import ops
from allspark_server.compute.steps import BoundMoe, Moe
from allspark_server.layers.linear import MergedColumnParallelLinear, RowParallelLinear, reduce_into_norm


class Router(nn.Module):
    """A replicated projection without bias ([out, H]): the router's logits, the shared expert's gate."""

    def __init__(self, hidden: int, out: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden, dtype=dtype), requires_grad=False)


class Expert(nn.Module):
    """One gated MLP, this rank's shard: its down projection's output is a partial sum until the layer reduces."""

    def __init__(self, hidden: int, inter_local: int, dtype: torch.dtype, comm):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [("gate_proj", inter_local), ("up_proj", inter_local)],
                                                       False, dtype)
        self.down_proj = RowParallelLinear(inter_local, hidden, False, dtype, comm)

    def weights(self) -> tuple:
        return self.gate_up_proj.kernel_weight, self.down_proj.kernel_weight


class SparseMoE(nn.Module):
    def __init__(self, args, world_size: int, dtype: torch.dtype, comm):
        super().__init__()
        h = args.hidden_size
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Router(h, args.num_experts, dtype)
        self.experts = nn.ModuleList(Expert(h, args.moe_intermediate_size // world_size, dtype, comm)
                                     for _ in range(args.num_experts))
        shared = args.shared_expert_intermediate_size
        self.shared_expert = Expert(h, shared // world_size, dtype, comm) if shared else None
        self.shared_expert_gate = Router(h, 1, dtype) if shared else None
        self.comm = comm

    def bound(self) -> BoundMoe:
        """This MLP as the layer description's Moe step over its weights (what compute/step_ops.py runs)."""
        shared = self.shared_expert
        step = Moe(len(self.experts), self.top_k, self.norm_topk_prob, shared is not None)
        return BoundMoe(step, self.gate.weight, [e.weights() for e in self.experts],
                        None if shared is None else shared.weights(),
                        None if shared is None else self.shared_expert_gate.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:       # [T, H] -> [T, H]
        b = self.bound()
        return self.reduce(ops.moe(x, b.router, b.experts, self.top_k, self.norm_topk_prob, b.shared, b.shared_gate))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        self.comm.allreduce_(partial)
        return partial

    def reduce_norm(self, partial: torch.Tensor, residual, norm):
        return reduce_into_norm(self.comm, partial, residual, norm, self.reduce)

    adds_bias = False
