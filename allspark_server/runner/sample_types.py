"""What a request's sampling carries and what a step's sampling returns, shared by the sampler (sampler.py) and its
draws (draws.py): SamplingState, a Row (its ids as TokenRuns), SampleResult, PendingSample, and the min_length
rule."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Iterator, Optional, Sequence

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


class TokenRun:
    """Token lists read as one sequence without copying them (a request's prompt + output, and a verify row's
    proposed tokens after them): its length and its tokens in order, all that sampling reads of a row's ids. Read
    it before the lists change (the sampler does, in start_rows)."""
    __slots__ = ("parts", "_len")

    def __init__(self, *parts: Sequence[int]):
        self.parts = parts
        self._len = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.parts)


# a row to sample: (state, all ids = prompt + output, output ids), lists or TokenRuns: sampling takes len() and
# iterates them
Row = tuple[SamplingState, Sequence[int], Sequence[int]]


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
