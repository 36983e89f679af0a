"""What a step computes besides the sampled rows' logits (rank 0): prompt rows' logits, turned into prompt logprobs,
and embedding rows' final-norm hidden states.

The runner splits the model's extra outputs into a StepRows; the served model turns them into each request's
prompt logprobs (`prompt_logprobs`, with the request's own top-k count) and pools its hidden rows (`pool_rows`).
Owns no request state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

LOGPROB_BLOCK_ROWS = 256     # prompt rows turned into logprobs at once

@dataclass
class StepRows:
    logits: Optional[torch.Tensor]     # [P, V] fp32: the logit rows of the step (None: none)
    targets: tuple                     # (request id, position, token id) of each
    hidden: dict                       # request id -> [rows, H] fp32 on the host, in row order


def split_rows(logits: torch.Tensor, hidden: torch.Tensor, num_sampled: int, targets: tuple,
               hidden_request_ids: tuple) -> tuple[torch.Tensor, StepRows]:
    """The model's (logits [N + P, V], hidden [E, H]) -> (the sampled rows' logits [N, V], the rest)."""
    by_request: dict[int, list[int]] = {}
    for i, rid in enumerate(hidden_request_ids):
        by_request.setdefault(rid, []).append(i)
    host = hidden.float().cpu() if hidden_request_ids else None
    rows = {rid: host[idx[0]:idx[-1] + 1] for rid, idx in by_request.items()}   # a chunk's rows are contiguous
    prompt = logits[num_sampled:] if targets else None
    return logits[:num_sampled], StepRows(prompt, targets, rows)


@torch.inference_mode()
def prompt_logprobs(rows: StepRows, top_k: Callable[[int], int]) -> dict:
    """request id -> [(position, log P(token at position), [(token id, logprob)] top_k(request id) best)]: the
    log-softmax of the raw logits (before any sampling rule), fp32."""
    if rows.logits is None:
        return {}
    tokens = torch.tensor([t for _, _, t in rows.targets], dtype=torch.long, device=rows.logits.device)
    ks = [top_k(rid) for rid, _, _ in rows.targets]
    k_max = max(ks, default=0)
    own, top_values, top_ids = [], [], []
    for i in range(0, len(ks), LOGPROB_BLOCK_ROWS):      # a long prompt's rows a block at a time: one [B, V] copy
        lp = torch.log_softmax(rows.logits[i:i + LOGPROB_BLOCK_ROWS].float(), -1)      # [B, V]
        own += lp.gather(1, tokens[i:i + LOGPROB_BLOCK_ROWS, None]).flatten().tolist()
        if k_max:
            top = torch.topk(lp, k_max)
            top_values += top.values.tolist()
            top_ids += top.indices.tolist()
    out: dict[int, list] = {}
    for i, (rid, pos, _) in enumerate(rows.targets):
        k = ks[i]
        best = list(zip(top_ids[i][:k], top_values[i][:k])) if k else []
        out.setdefault(rid, []).append((pos, own[i], best))
    return out


def pool_rows(parts: list[torch.Tensor], pooling: str, normalize: bool) -> torch.Tensor:
    """One input's hidden rows (chunks in order, each [rows, H] fp32) -> its embedding [H] fp32: the last row
    ("last") or the mean of all ("mean", summed in float64), L2-normalized when `normalize`."""
    if pooling == "last":
        v = parts[-1][-1]
    else:
        v = (torch.cat(parts).double().sum(0) / sum(p.shape[0] for p in parts)).float()
    if normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v


@dataclass
class EmbedJob:
    """One embedding request's pooling and what its steps computed: hidden rows by the position of their chunk's
    first row (a preempted request computes them again from 0), then the pooled vector."""
    pooling: str
    normalize: bool
    parts: dict
    result: Optional[torch.Tensor] = None

    def add(self, start: int, rows: torch.Tensor) -> None:
        if start == 0:
            self.parts.clear()
        self.parts[start] = rows

    def finish(self) -> None:
        self.result = pool_rows([self.parts[s] for s in sorted(self.parts)], self.pooling, self.normalize)
