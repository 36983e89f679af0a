"""Sampler semantics stage by stage at the processor level: repetition / presence / frequency penalties, top_k,
top_p, temperature and min_length, each against transformers' logits processors, float64 references and hand-worked
examples, on the host's sampler (its draws: torch.multinomial with each request's own generator); the whole chain,
greedy and logprobs: test_sampler_chain.py.
"""
from __future__ import annotations

import pytest
import torch
from helpers import hf_apply, presence_frequency_ref
from sampler_cases import NEG_INF, SEEDS, rand_ids, rand_logits, sample
from transformers import (
    MinLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from allspark_client.config import GenerationConfig
from allspark_server.runner.sampler import SamplingState, apply_penalties_rows, mask_top_k_top_p

VOCABS = [1000, 7]


def assert_same_masked(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    """Same -inf entries, and the remaining values equal."""
    a_inf, e_inf = torch.isneginf(actual), torch.isneginf(expected)
    assert torch.equal(a_inf, e_inf), (f"masked differ: only ours {torch.nonzero(a_inf & ~e_inf).flatten().tolist()}, "
                                       f"only HF {torch.nonzero(e_inf & ~a_inf).flatten().tolist()}")
    torch.testing.assert_close(actual[~a_inf], expected[~e_inf], rtol=0, atol=atol)


def penalized(x: torch.Tensor, all_ids, output_ids, gen: GenerationConfig) -> torch.Tensor:
    """The sampler's penalties on one row x [V]."""
    return apply_penalties_rows(x[None].clone(), [(SamplingState.create(gen), list(all_ids), list(output_ids))])[0]


def mask_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    return mask_top_k_top_p(x[None].clone(), [k], [1.0])[0]


def mask_top_p(x: torch.Tensor, p: float) -> torch.Tensor:
    return mask_top_k_top_p(x[None].clone(), [0], [p])[0]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7, 2.0])
def test_repetition_penalty_matches_hf(vocab, seed, penalty):
    x = rand_logits(vocab, seed)
    all_ids = rand_ids(40, vocab, seed)            # duplicates included; vocab 7 touches nearly all tokens
    output_ids = all_ids[25:]
    ours = penalized(x, all_ids, output_ids, GenerationConfig(repetition_penalty=penalty))
    expected = hf_apply(RepetitionPenaltyLogitsProcessor(penalty), all_ids, x)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    if penalty != 1.0:
        untouched = torch.ones(vocab, dtype=torch.bool)
        untouched[all_ids] = False
        assert torch.equal(ours[untouched], x[untouched])


def test_repetition_penalty_covers_prompt_ids():
    # hand-worked: prompt tokens are penalized too (HF semantics), each token once however often it occurs
    x = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5])
    ours = penalized(x, [0, 1, 1, 1], [], GenerationConfig(repetition_penalty=2.0))
    assert ours.tolist() == [0.5, -2.0, 2.0, 0.5, -0.5]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (0.5, 0.3), (-1.0, 0.7), (1.5, -0.4)])
def test_presence_frequency_match_float64(vocab, seed, presence, frequency):
    x = rand_logits(vocab, seed)
    prompt = rand_ids(20, vocab, seed + 100)
    output_ids = rand_ids(30, vocab, seed + 200)
    ours = penalized(x, prompt + output_ids, output_ids,
                     GenerationConfig(presence_penalty=presence, frequency_penalty=frequency))
    expected = presence_frequency_ref(x, output_ids, presence, frequency)
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-5)
    # prompt-only tokens are not touched by presence/frequency
    prompt_only = sorted(set(prompt) - set(output_ids))
    assert torch.equal(ours[prompt_only], x[prompt_only])


@pytest.mark.parametrize("seed", SEEDS)
def test_repetition_then_presence_frequency_matches_reference(seed):
    vocab = 1000
    x = rand_logits(vocab, seed)
    prompt, output_ids = rand_ids(50, vocab, seed), rand_ids(40, vocab, seed + 7)
    gen = GenerationConfig(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.25)
    ours = penalized(x, prompt + output_ids, output_ids, gen)
    expected = presence_frequency_ref(hf_apply(RepetitionPenaltyLogitsProcessor(1.4), prompt + output_ids, x),
                                      output_ids, 0.6, 0.25)
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-5)


def test_penalties_hand_worked():
    x = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0])
    prompt, output_ids = [0, 1], [2, 2, 3]
    ours = penalized(x, prompt + output_ids, output_ids,
                     GenerationConfig(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    # repetition over {0,1,2,3}: 0.5, -2, 1, 0.25; then token 2 (count 2): 1 - 0.5 - 0.5 = 0,
    # token 3 (count 1): 0.25 - 0.25 - 0.5 = -0.5
    torch.testing.assert_close(ours, torch.tensor([0.5, -2.0, 0.0, -0.5, -0.5, 0.0, 3.0]))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 2, 5, 50, 999, 1000, 1003])
def test_top_k_matches_hf(vocab, seed, k):
    x = rand_logits(vocab, seed)
    assert_same_masked(mask_top_k(x.clone(), k), hf_apply(TopKLogitsWarper(k), [], x), atol=0)
    kept = int((~torch.isneginf(mask_top_k(x.clone(), k))).sum())
    assert kept == min(k, vocab)


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_zero_is_off(vocab):
    x = rand_logits(vocab, 5)
    assert torch.equal(mask_top_k(x.clone(), 0), x)


def test_top_k_ties_and_prior_mask_match_hf():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, NEG_INF, 0.5])
    for k in (1, 2, 3, 4, 6):
        assert_same_masked(mask_top_k(x.clone(), k), hf_apply(TopKLogitsWarper(k), [], x), atol=0)
    # hand-worked: k=2 keeps every token tied with the 2nd largest value
    assert torch.isneginf(mask_top_k(x.clone(), 2)).tolist() == [True, False, False, True, False, True, True]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.01, 0.2, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
def test_top_p_matches_hf(vocab, seed, p):
    for scale in (0.5, 3.0):
        x = rand_logits(vocab, seed, scale)
        assert_same_masked(mask_top_p(x.clone(), p), hf_apply(TopPLogitsWarper(p), [], x), atol=0)
        # after top_k (entries already -inf)
        xk = hf_apply(TopKLogitsWarper(min(5, vocab - 1)), [], x)
        assert_same_masked(mask_top_p(xk.clone(), p), hf_apply(TopPLogitsWarper(p), [], xk), atol=0)


@pytest.mark.parametrize("p,kept", [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_hand_worked(p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05: keep the smallest most-likely set whose mass reaches p
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = mask_top_p(x.clone(), p)
    assert torch.nonzero(~torch.isneginf(out)).flatten().tolist() == kept
    assert torch.equal(out[kept], x[kept])


@pytest.mark.parametrize("p,n_kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.9, 4)])
def test_top_p_exact_boundary(p, n_kept):
    # four equal logits: probabilities are exactly 0.25 and the cumulative sums exactly 0.25, 0.5, 0.75, 1;
    # a mass of exactly p already "reaches" p, so p=0.5 keeps 2 tokens, not 3
    x = torch.zeros(4)
    out = mask_top_p(x.clone(), p)
    hf = hf_apply(TopPLogitsWarper(p), [], x)
    assert int((~torch.isneginf(out)).sum()) == int((~torch.isneginf(hf)).sum()) == n_kept
    # which of the tied tokens stay: the lower ids (transformers keeps those its unstable sort puts last)
    assert torch.nonzero(~torch.isneginf(out)).flatten().tolist() == list(range(n_kept))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.5, 5.0])
def test_temperature_matches_hf(multinomial_spy, vocab, seed, t):
    x = rand_logits(vocab, seed)
    sample(GenerationConfig(temperature=t, seed=1), x, [], [])
    assert len(multinomial_spy) == 1
    expected = torch.softmax(hf_apply(TemperatureLogitsWarper(t), [], x).double(), -1)
    torch.testing.assert_close(multinomial_spy[0].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("eos", [(4,), (4, 9, 2)])
@pytest.mark.parametrize("history_len,min_length", [(3, 8), (7, 8), (8, 8), (9, 8), (5, 0)])
def test_min_length_matches_hf(multinomial_spy, eos, history_len, min_length):
    vocab = 12
    x = rand_logits(vocab, 11)
    x[list(eos)] = x.max() + torch.arange(1, len(eos) + 1, dtype=torch.float)   # EOS ids are the most likely
    all_ids = rand_ids(history_len, vocab, 3)
    output_ids = all_ids[2:]
    expected = x.clone() if not min_length else hf_apply(MinLengthLogitsProcessor(min_length, list(eos)), all_ids, x)
    masked_expected = history_len < min_length
    assert bool(torch.isneginf(expected[list(eos)]).all()) == masked_expected
    # sampling path: the distribution handed to the draw is softmax of HF's output
    sample(GenerationConfig(min_length=min_length, eos_token_ids=eos, seed=3), x, all_ids, output_ids)
    torch.testing.assert_close(multinomial_spy[0].double(), torch.softmax(expected.double(), -1),
                               rtol=1e-5, atol=1e-7)
    # greedy path
    res = sample(GenerationConfig(min_length=min_length, eos_token_ids=eos, do_sample=False), x, all_ids, output_ids)
    assert res.token_id == int(torch.argmax(expected))
    assert (res.token_id in eos) == (not masked_expected)
