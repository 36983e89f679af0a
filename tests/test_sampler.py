"""Sampler semantics, checked against independent references.

References: transformers' logits processors / warpers (RepetitionPenalty, MinLength, Temperature, TopK,
TopP), float64 computations written here (presence / frequency penalties, log_softmax), hand-worked
examples, and the HF fp32 model run step by step for the engine-level checks.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (MinLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from allspark_client import AsStatus, GenerateRequestStatus
from allspark_client.config import GenerationConfig
from allspark_server.runner.sampler import Sampler, SamplingState, apply_penalties, mask_top_k, mask_top_p
from helpers import collect, generate, random_prompt

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------------
# references
# ------------------------------------------------------------------------------------------------

def rand_logits(vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * scale).float()


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def hf_apply(proc, all_ids: list[int], x: torch.Tensor) -> torch.Tensor:
    """Run one HF logits processor on a single row x [V] with history all_ids."""
    ids = torch.tensor([list(all_ids)], dtype=torch.long)
    return proc(ids, x[None].clone())[0]


def presence_frequency_ref(x: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI-style penalties over the output only, in float64: logit -= frequency*count + presence*(count>0)."""
    out = x.double().clone()
    for tok, count in Counter(output_ids).items():
        out[tok] -= frequency * count + presence
    return out


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


def assert_same_masked(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    """Same -inf entries, and the remaining values equal."""
    a_inf, e_inf = torch.isneginf(actual), torch.isneginf(expected)
    assert torch.equal(a_inf, e_inf), (f"masked differ: only ours {torch.nonzero(a_inf & ~e_inf).flatten().tolist()}, "
                                       f"only HF {torch.nonzero(e_inf & ~a_inf).flatten().tolist()}")
    torch.testing.assert_close(actual[~a_inf], expected[~e_inf], rtol=0, atol=atol)


@pytest.fixture
def multinomial_spy(monkeypatch):
    """Record the probability vector handed to torch.multinomial (the draw itself is unchanged)."""
    seen = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    return seen


def sample(gen: GenerationConfig, x: torch.Tensor, all_ids, output_ids, state: SamplingState | None = None):
    state = state or SamplingState.create(gen)
    return Sampler().sample_row(x.clone(), state, list(all_ids), list(output_ids))


SEEDS = [0, 1, 2, 3]
VOCABS = [1000, 7]


# ------------------------------------------------------------------------------------------------
# 1. unit level: each stage against HF / float64
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7, 2.0])
def test_repetition_penalty_matches_hf(vocab, seed, penalty):
    x = rand_logits(vocab, seed)
    all_ids = rand_ids(40, vocab, seed)            # duplicates included; vocab 7 touches nearly all tokens
    output_ids = all_ids[25:]
    ours = x.clone()
    apply_penalties(ours, all_ids, output_ids, GenerationConfig(repetition_penalty=penalty))
    expected = hf_apply(RepetitionPenaltyLogitsProcessor(penalty), all_ids, x)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    if penalty != 1.0:
        untouched = torch.ones(vocab, dtype=torch.bool)
        untouched[all_ids] = False
        assert torch.equal(ours[untouched], x[untouched])


def test_repetition_penalty_covers_prompt_ids():
    # hand-worked: prompt tokens are penalized too (HF semantics), each token once however often it occurs
    x = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5])
    ours = x.clone()
    apply_penalties(ours, [0, 1, 1, 1], [], GenerationConfig(repetition_penalty=2.0))
    assert ours.tolist() == [0.5, -2.0, 2.0, 0.5, -0.5]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (0.5, 0.3), (-1.0, 0.7), (1.5, -0.4)])
def test_presence_frequency_match_float64(vocab, seed, presence, frequency):
    x = rand_logits(vocab, seed)
    prompt = rand_ids(20, vocab, seed + 100)
    output_ids = rand_ids(30, vocab, seed + 200)
    ours = x.clone()
    apply_penalties(ours, prompt + output_ids, output_ids,
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
    ours = x.clone()
    apply_penalties(ours, prompt + output_ids, output_ids, gen)
    expected = presence_frequency_ref(hf_apply(RepetitionPenaltyLogitsProcessor(1.4), prompt + output_ids, x),
                                      output_ids, 0.6, 0.25)
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-5)


def test_penalties_hand_worked():
    x = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0])
    prompt, output_ids = [0, 1], [2, 2, 3]
    ours = x.clone()
    apply_penalties(ours, prompt + output_ids, output_ids,
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
    assert int((~torch.isneginf(out)).sum()) == n_kept
    assert_same_masked(out, hf_apply(TopPLogitsWarper(p), [], x), atol=0)


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


CHAIN_CASES = [
    # (vocab-10 hand-set logits) full chain: eos masked by min_length, top_k and top_p both cut
    dict(x=[2.0, 1.6, 1.3, 1.1, 0.9, 0.7, 0.4, 0.1, -0.3, -1.0], prompt=[3, 8], output=[1, 1, 5],
         cfg=dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, min_length=6,
                  eos_token_ids=(0,), temperature=0.7, top_k=6, top_p=0.8)),
    # pure temperature sampling over 8 tokens
    dict(x=[0.3, -0.2, 1.0, 0.0, 0.5, -1.0, 0.8, 0.1], prompt=[2], output=[],
         cfg=dict(temperature=1.3)),
    # temperature comes before top_p: at T=0.3 top_p=0.7 keeps 2 tokens (5 if the order were swapped)
    dict(x=[1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -0.2, -0.4], prompt=[7], output=[], cfg=dict(temperature=0.3, top_p=0.7)),
    # top_p alone, with repetition penalty lowering the favourite
    dict(x=[2.5, 0.4, 1.9, 1.7, -0.5, 0.2, 1.0, 0.0, -2.0, 0.6, 1.2, -0.1], prompt=[0, 0, 2], output=[7],
         cfg=dict(repetition_penalty=1.8, temperature=0.9, top_p=0.7)),
]


def _chain_reference(case) -> torch.Tensor:
    c = case["cfg"]
    x = torch.tensor(case["x"])
    s = reference_processed(x, case["prompt"] + case["output"], case["output"],
                            rep=c.get("repetition_penalty", 1.0), presence=c.get("presence_penalty", 0.0),
                            frequency=c.get("frequency_penalty", 0.0), min_length=c.get("min_length", 0),
                            eos=c.get("eos_token_ids", ()), temperature=c.get("temperature", 1.0),
                            top_k=c.get("top_k", 0), top_p=c.get("top_p", 1.0))
    return torch.softmax(s.double(), -1)


@pytest.mark.parametrize("case", CHAIN_CASES)
def test_chain_distribution_exact(multinomial_spy, case):
    ref = _chain_reference(case)
    sample(GenerationConfig(seed=0, **case["cfg"]), torch.tensor(case["x"]), case["prompt"] + case["output"],
           case["output"])
    torch.testing.assert_close(multinomial_spy[0].double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(multinomial_spy[0] == 0, ref == 0)


@pytest.mark.parametrize("case", CHAIN_CASES)
def test_chain_distribution_statistical(case):
    ref = _chain_reference(case)
    if case["cfg"].get("top_k"):
        # the case is meant to exercise every stage: EOS gone, top_k and top_p each removed something
        assert ref[0] == 0 and 2 < int((ref > 0).sum()) < case["cfg"]["top_k"]
    gen = GenerationConfig(seed=1234, **case["cfg"])
    state = SamplingState.create(gen)
    x = torch.tensor(case["x"])
    all_ids, output_ids = case["prompt"] + case["output"], case["output"]
    sampler = Sampler()
    n = 4000
    counts = torch.zeros(len(case["x"]), dtype=torch.float64)
    for _ in range(n):
        counts[sampler.sample_row(x.clone(), state, all_ids, output_ids).token_id] += 1
    freq = counts / n
    assert float((freq - ref).abs().max()) < 0.03, (freq.tolist(), ref.tolist())
    assert counts[ref == 0].sum() == 0, "drew a token that top_k / top_p / min_length removed"


def test_same_seed_same_draws_different_seed_differs():
    x = rand_logits(50, 0, scale=0.5)
    gens = [GenerationConfig(temperature=1.0, seed=s) for s in (7, 7, 8)]
    seqs = []
    for gen in gens:
        state = SamplingState.create(gen)
        seqs.append([Sampler().sample_row(x.clone(), state, [], []).token_id for _ in range(40)])
    assert seqs[0] == seqs[1]
    assert seqs[0] != seqs[2]


# ------------------------------------------------------------------------------------------------
# 2. greedy
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("greedy_cfg", [dict(top_k=1), dict(temperature=0.0), dict(do_sample=False),
                                        dict(do_sample=False, temperature=0.5, top_k=5, top_p=0.5)])
@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_is_argmax_of_processed(multinomial_spy, greedy_cfg, seed):
    vocab = 64
    x = rand_logits(vocab, seed)
    order = torch.argsort(x, descending=True).tolist()
    eos = order[0]                          # raw favourite: an EOS masked by min_length
    prompt = [order[1], 3, 5]               # 2nd: penalized by repetition (prompt)
    output_ids = [order[2], order[2]]       # 3rd: penalized by repetition + presence/frequency (output)
    cfg = dict(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3, min_length=10,
               eos_token_ids=(eos,), **greedy_cfg)
    expected = reference_processed(x, prompt + output_ids, output_ids, rep=1.5, presence=0.4, frequency=0.3,
                                   min_length=10, eos=(eos,))
    res = sample(GenerationConfig(**cfg), x, prompt + output_ids, output_ids)
    assert res.token_id == int(torch.argmax(expected))
    assert res.token_id not in order[:3]
    assert multinomial_spy == [], "greedy decoding must not draw"
    # plain greedy: raw argmax
    res = sample(GenerationConfig(**greedy_cfg), x, prompt + output_ids, output_ids)
    assert res.token_id == order[0]


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_of_raw_logits(greedy):
    vocab = 100
    x = rand_logits(vocab, 4)
    order = torch.argsort(x, descending=True).tolist()
    cfg = dict(repetition_penalty=1.7, presence_penalty=1.0, logprobs=True, top_logprobs=4, seed=5,
               min_length=50, eos_token_ids=(order[1],))
    cfg.update(top_k=1 if greedy else 20, temperature=0.5)
    res = sample(GenerationConfig(**cfg), x, [order[0], order[2]], [order[0]])
    raw = torch.log_softmax(x.double(), -1)
    assert res.logprob == pytest.approx(float(raw[res.token_id]), abs=1e-5)
    top = torch.topk(raw, 4)
    assert [t for t, _ in res.top_logprobs] == top.indices.tolist()
    assert [v for _, v in res.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    if greedy:   # the penalties / min_length moved the choice away from the raw top 3
        assert res.token_id not in order[:3]


# ------------------------------------------------------------------------------------------------
# 3. engine level
# ------------------------------------------------------------------------------------------------

SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "max_new_tokens": 32, "eos_token_id": []}


def test_engine_seed_reproducible(served_llama):
    engine, _ = served_llama
    ids = random_prompt(12, 21)
    a, _ = generate(engine, "llama", ids, dict(SAMPLING, seed=1))
    b, _ = generate(engine, "llama", ids, dict(SAMPLING, seed=1))
    c, _ = generate(engine, "llama", ids, dict(SAMPLING, seed=2))
    assert len(a) == 32
    assert a == b
    assert a != c
    # the same seeds, run concurrently in one batch, give the same streams (rows are independent)
    started = []
    for seed in (1, 2, 1):
        status, handle, queue = engine.start_request("llama", {"input_ids": ids}, dict(SAMPLING, seed=seed))
        assert status == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        started.append((handle, queue))
    try:
        outs = []
        for _, queue in started:
            tokens, _, final = collect(queue)
            assert final == GenerateRequestStatus.GenerateFinished
            outs.append(tokens)
    finally:
        for handle, _ in started:
            engine.release_request("llama", handle)
    assert outs == [a, c, a]


def _flatten_logprobs(elements):
    token_lp, top_lp = [], []
    for el in elements:
        assert len(el.token_logprobs_list) == len(el.ids_from_generate) == len(el.log_probs_list)
        token_lp.extend(el.token_logprobs_list)
        top_lp.extend(el.log_probs_list)
    return token_lp, top_lp


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double()


@pytest.mark.parametrize("greedy_key", [{"top_k": 1}, {"do_sample": False}])
def test_engine_logprobs_match_hf(served_llama, llama, greedy_key):
    engine, _ = served_llama
    prompt = random_prompt(9, 31)
    n = 16
    tokens, elements = generate(engine, "llama", prompt, dict(greedy_key, max_new_tokens=n, eos_token_id=[],
                                                              logprobs=True, top_logprobs=5))
    assert len(tokens) == n
    token_lp, top_lp = _flatten_logprobs(elements)
    assert len(token_lp) == len(top_lp) == n
    ref = torch.log_softmax(_hf_logits(llama.model, prompt + tokens[:-1]), -1)[len(prompt) - 1:]
    for i, tok in enumerate(tokens):
        assert token_lp[i] == pytest.approx(float(ref[i, tok]), abs=1e-4)
        pairs = top_lp[i]
        assert len(pairs) == 5
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in pairs)
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        assert token_lp[i] == pytest.approx(max(values), abs=1e-6)      # greedy picks the top logprob
        assert pairs[0][0] == tok
        hf_top = torch.topk(ref[i], 5)
        assert [t for t, _ in pairs] == hf_top.indices.tolist()
        assert values == pytest.approx(hf_top.values.tolist(), abs=1e-4)


def test_engine_logprobs_without_top(served_llama, llama):
    engine, _ = served_llama
    prompt = random_prompt(7, 32)
    tokens, elements = generate(engine, "llama", prompt, dict(SAMPLING, max_new_tokens=6, seed=3,
                                                              logprobs=True, top_logprobs=0))
    token_lp, top_lp = _flatten_logprobs(elements)
    assert top_lp == [[]] * 6
    # sampled (not greedy): still the raw-logit logprob of the chosen token
    ref = torch.log_softmax(_hf_logits(llama.model, prompt + tokens[:-1]), -1)[len(prompt) - 1:]
    assert token_lp == pytest.approx([float(ref[i, t]) for i, t in enumerate(tokens)], abs=1e-4)
    # logprobs off: nothing reported
    _, elements = generate(engine, "llama", prompt, dict(SAMPLING, max_new_tokens=3, seed=3))
    assert all(el.token_logprobs_list == [] and el.log_probs_list == [] for el in elements)


@pytest.mark.parametrize("key,value", [("top_logprobs", 11), ("temperature", -1), ("top_p", 0), ("top_k", -1),
                                       ("repetition_penalty", 3), ("seed", -1), ("presence_penalty", 2.5),
                                       ("frequency_penalty", -2.5), ("logprobs", "yes"), ("do_sample", 1),
                                       ("foo", 1)])
def test_engine_rejects_bad_generation_config(served_llama, key, value):
    engine, _ = served_llama
    status, handle, queue = engine.start_request("llama", {"input_ids": [5, 6, 7]},
                                                 {"max_new_tokens": 4, key: value})
    assert status == AsStatus.ALLSPARK_PARAM_ERROR
    assert handle is None and queue is None
    assert key in engine.get_last_error()


# ------------------------------------------------------------------------------------------------
# 4. penalties and min_length at engine level vs HF reference loops
# ------------------------------------------------------------------------------------------------

def hf_reference_loop(model, prompt, max_new: int, process, eos=()) -> list[int]:
    """Greedy decoding with the HF model, full recompute each step; process(all_ids, out, logits[V]) -> logits."""
    ids, out = list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(torch.argmax(process(list(ids), list(out), logits)))
        ids.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


@pytest.mark.parametrize("prompt_seed", [41, 42])
def test_engine_repetition_penalty_matches_hf_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(10, prompt_seed)
    ref = hf_reference_loop(llama.model, prompt, 24,
                            lambda ids, out, lg: hf_apply(RepetitionPenaltyLogitsProcessor(1.3), ids, lg))
    plain = hf_reference_loop(llama.model, prompt, 24, lambda ids, out, lg: lg)
    assert ref != plain, "penalty should change this greedy continuation"
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 24,
                                                   "eos_token_id": []})
    assert tokens == ref


@pytest.mark.parametrize("prompt_seed", [43, 44])
def test_engine_presence_frequency_match_float64_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(10, prompt_seed)
    ref = hf_reference_loop(llama.model, prompt, 24,
                            lambda ids, out, lg: presence_frequency_ref(lg, out, 0.5, 0.3))
    plain = hf_reference_loop(llama.model, prompt, 24, lambda ids, out, lg: lg)
    assert ref != plain, "penalties should change this greedy continuation"
    tokens, _ = generate(engine, "llama", prompt, {"do_sample": False, "presence_penalty": 0.5,
                                                   "frequency_penalty": 0.3, "max_new_tokens": 24,
                                                   "eos_token_id": []})
    assert tokens == ref


@pytest.mark.parametrize("prompt_seed", [45, 46])
def test_engine_min_length_matches_hf_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(8, prompt_seed)
    first = int(torch.argmax(_hf_logits(llama.model, prompt)[-1]))
    eos = (first,)
    min_length = len(prompt) + 5
    # without min_length the request ends at once on its (forced) EOS
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first]})
    assert tokens == [first]
    ref = hf_reference_loop(llama.model, prompt, 16,
                            lambda ids, out, lg: hf_apply(MinLengthLogitsProcessor(min_length, [first]), ids, lg),
                            eos=eos)
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first],
                                                   "min_length": min_length})
    assert first not in tokens[:5]
    assert len(tokens) >= 5
    assert tokens == ref
