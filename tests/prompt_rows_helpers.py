"""transformers references of prompt logprobs and embeddings, shared by the Engine, pool and HTTP tests."""
from __future__ import annotations

import numpy as np
import torch


def hf_prompt_logprobs(model, ids) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= 1 and each position's whole log-softmax, float64: ([L-1], [L-1, V])."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].double(), -1)[:-1]   # [L-1, V]
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).flatten(), lp


def hf_embedding(model, ids, pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        h = model.model(torch.tensor([list(ids)])).last_hidden_state[0].double()   # after the final norm
    v = h[-1] if pooling == "last" else h.mean(0)
    if normalize:
        v = v / v.norm()
    return v.numpy()


def check_prompt_logprobs(model, ids, el, k: int) -> None:
    assert len(el.prompt_logprobs) == len(ids) and el.prompt_logprobs[0] is None
    assert el.prompt_top_logprobs[0] == []
    own, lp = hf_prompt_logprobs(model, ids)
    got = torch.tensor(el.prompt_logprobs[1:], dtype=torch.float64)
    assert torch.allclose(got, own, atol=1e-4, rtol=0), (got - own).abs().max()
    for i, top in enumerate(el.prompt_top_logprobs[1:]):
        assert len(top) == k
        want = torch.topk(lp[i], k)
        assert [t for t, _ in top] == want.indices.tolist(), i
        assert np.allclose([v for _, v in top], want.values.numpy(), atol=1e-4)
