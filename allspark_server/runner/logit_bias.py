"""logit_bias (rank 0's sampler): each request's {token id: bias} added to its rows' logits, in place, before anything
else of the sampler reads them (so greedy, the draw, penalties and the logprobs all see the biased logits).

Only rows whose request carries a bias are touched, all of them with one index_put_; a verify chunk's rows are its
request's rows like any, so speculative decoding verifies against the biased distribution. The bias depends on
nothing a step produces, so a plain greedy row stays one argmax of the (biased) logits.
"""
from __future__ import annotations

from typing import Sequence

import torch

from allspark_server.runner.sample_types import Row


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    """Add each row's gen.logit_bias to its row of logits [N, V], in place (rows without a bias are left alone)."""
    at, ids, values = [], [], []
    for i, (state, _, _) in enumerate(rows):
        for t, b in state.gen.logit_bias:
            at.append(i)
            ids.append(t)
            values.append(b)
    if not at:
        return
    dev = logits.device
    r = torch.tensor(at, dtype=torch.long).to(dev, non_blocking=True)
    c = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
    v = torch.tensor(values, dtype=logits.dtype).to(dev, non_blocking=True)
    with torch.inference_mode():      # the runner's logits are inference tensors
        logits.index_put_((r, c), v, accumulate=True)
