"""What a request's sampling carries and what a step's sampling returns, shared by the host sampler (sampler.py)
and the batched GPU one (batch_sampler.py): SamplingState, SampleResult, PendingSample, and the min_length rule."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from allspark_client.generation_config import GenerationConfig
from allspark_server.runner.guided import GuidedState


@dataclass
class SamplingState:
    gen: GenerationConfig
    generator: Optional[torch.Generator] = None   # the host path's draws
    guided: Optional["GuidedState"] = None   # allspark_server.runner.guided: where a response_format request's output is
    seed: int = 0                            # gen.seed, else a random one (sampling requests); batch_sampler's draws

    @classmethod
    def create(cls, gen: GenerationConfig) -> "SamplingState":
        if gen.is_greedy:
            return cls(gen)
        seed = gen.seed if gen.seed is not None else random.SystemRandom().getrandbits(63)
        g = torch.Generator()
        g.manual_seed(seed)
        return cls(gen, g, seed=seed)


@dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float] = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class PendingSample:
    """A step's sampling: `tokens` [N] (long, on the logits' device) and `results()`.
    For GPU logits the values the host needs are copied to pinned memory as soon as they are computed: reading
    them later waits for that copy only, not for work queued on the GPU after it (the next step)."""

    def __init__(self, tokens: Optional[torch.Tensor], values: Optional[torch.Tensor] = None,
                 parse: Optional[Callable[[list], list[SampleResult]]] = None,
                 results: Optional[list[SampleResult]] = None):
        self.tokens = tokens
        self._results, self._parse, self._ready = results, parse, None
        if values is not None:
            self._host = values.to("cpu", non_blocking=True)   # pinned: an asynchronous copy
            if values.is_cuda:
                self._ready = torch.cuda.Event()
                self._ready.record()

    def results(self) -> list[SampleResult]:
        if self._results is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._results = self._parse(self._host.tolist())
        return self._results


def suppresses_eos(gen: GenerationConfig, num_tokens: int) -> bool:
    """min_length not reached yet by the request's `num_tokens` (prompt + output): the EOS tokens are masked."""
    return bool(gen.min_length and num_tokens < gen.min_length and gen.eos_token_ids)
