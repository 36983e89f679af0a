"""What a request's sampling carries and what a step's sampling returns, shared by the sampler (sampler.py) and its
draws (draws.py): SamplingState, a Row, SampleResult, PendingSample, and the min_length rule."""
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
    generator: Optional[torch.Generator] = None   # the host's draws (draws.multinomial_draws)
    guided: Optional["GuidedState"] = None   # guided.py: where a response_format request's output is in its grammar
    seed: int = 0                            # gen.seed, else a random one (sampling requests); a GPU's draws

    @classmethod
    def create(cls, gen: GenerationConfig) -> "SamplingState":
        if gen.is_greedy:
            return cls(gen)
        seed = gen.seed if gen.seed is not None else random.SystemRandom().getrandbits(63)
        g = torch.Generator()
        g.manual_seed(seed)
        return cls(gen, g, seed=seed)


Row = tuple[SamplingState, list[int], list[int]]   # a row to sample: (state, all_ids = prompt + output, output_ids)


@dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float] = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class PendingSample:
    """A step's sampling: `tokens` [N] (long, on the logits' device) and `results()`. What the host needs is in `host`
    (a flat tensor that `parse` turns into the results), or already in `results`. On a GPU `host` is a copy to pinned
    memory queued as soon as the values were computed and `ready` an event recorded after it: reading the results
    waits for that copy only, not for work queued on the GPU after it (the next step)."""

    def __init__(self, tokens: Optional[torch.Tensor], host: Optional[torch.Tensor] = None, ready=None,
                 parse: Optional[Callable[[list], list[SampleResult]]] = None,
                 results: Optional[list[SampleResult]] = None):
        self.tokens = tokens
        self._host, self._ready, self._parse, self._results = host, ready, parse, results

    def results(self) -> list[SampleResult]:
        if self._results is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._results = self._parse(self._host.tolist())
        return self._results


def suppresses_eos(gen: GenerationConfig, num_tokens: int) -> bool:
    """min_length not reached yet by the request's `num_tokens` (prompt + output): the EOS tokens are masked."""
    return bool(gen.min_length and num_tokens < gen.min_length and gen.eos_token_ids)
