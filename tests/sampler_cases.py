"""The sampler tests' pieces (test_sampler_units.py, test_sampler_chain.py): seeded random logits and token ids, the
documented processing chain built from transformers' logits processors (+ the float64 presence / frequency
reference), and the host sampler on one row."""
from __future__ import annotations

import torch
from helpers import hf_apply, presence_frequency_ref
from transformers import (
    MinLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from allspark_client.config import GenerationConfig
from allspark_server.runner.sampler import Sampler, SamplingState

NEG_INF = float("-inf")


SEEDS = [0, 1, 2, 3]


def rand_logits(vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * scale).float()


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def reference_processed(x: torch.Tensor, all_ids: list[int], output_ids: list[int], *, rep: float = 1.0,
                        presence: float = 0.0, frequency: float = 0.0, min_length: int = 0, eos=(),
                        temperature: float | None = None, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The documented chain built from HF processors (+ the float64 presence/frequency reference)."""
    s = x.clone()
    if rep != 1.0:
        s = hf_apply(RepetitionPenaltyLogitsProcessor(rep), all_ids, s)
    if presence or frequency:
        s = presence_frequency_ref(s, output_ids, presence, frequency).float()
    if min_length and eos:
        s = hf_apply(MinLengthLogitsProcessor(min_length, list(eos)), all_ids, s)
    if temperature is not None:
        s = hf_apply(TemperatureLogitsWarper(temperature), all_ids, s)
    if top_k:
        s = hf_apply(TopKLogitsWarper(top_k), all_ids, s)
    if top_p < 1.0:
        s = hf_apply(TopPLogitsWarper(top_p), all_ids, s)
    return s


def sample(gen: GenerationConfig, x: torch.Tensor, all_ids, output_ids, state: SamplingState | None = None):
    """The host sampler on one row x [V]."""
    state = state or SamplingState.create(gen)
    return Sampler("cpu").sample_rows(x[None].clone(), [(state, list(all_ids), list(output_ids))])[0]
