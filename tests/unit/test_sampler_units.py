"""Sampler semantics at the processor level: penalties, min_length, temperature, top_k / top_p, the full
chain and greedy, against transformers' logits processors, float64 references and hand-worked examples, on the
host's sampler (its draws: torch.multinomial with each request's own generator).
"""
from __future__ import annotations

import pytest
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
from allspark_server.runner.sampler import Sampler, SamplingState, apply_penalties_rows, argmax, mask_top_k_top_p

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
    """The host sampler on one row x [V]."""
    state = state or SamplingState.create(gen)
    return Sampler("cpu").sample_rows(x[None].clone(), [(state, list(all_ids), list(output_ids))])[0]


def penalized(x: torch.Tensor, all_ids, output_ids, gen: GenerationConfig) -> torch.Tensor:
    """The sampler's penalties on one row x [V]."""
    return apply_penalties_rows(x[None].clone(), [(SamplingState.create(gen), list(all_ids), list(output_ids))])[0]


def mask_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    return mask_top_k_top_p(x[None].clone(), [k], [1.0])[0]


def mask_top_p(x: torch.Tensor, p: float) -> torch.Tensor:
    return mask_top_k_top_p(x[None].clone(), [0], [p])[0]


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
    n = 4000   # one batch of n rows that share the request's generator: n draws of its stream
    drawn = Sampler("cpu").sample_rows(x.expand(n, -1).clone(), [(state, all_ids, output_ids)] * n)
    counts = torch.bincount(torch.tensor([r.token_id for r in drawn]), minlength=len(case["x"])).double()
    freq = counts / n
    assert float((freq - ref).abs().max()) < 0.03, (freq.tolist(), ref.tolist())
    assert counts[ref == 0].sum() == 0, "drew a token that top_k / top_p / min_length removed"


def test_same_seed_same_draws_different_seed_differs():
    x = rand_logits(50, 0, scale=0.5)
    gens = [GenerationConfig(temperature=1.0, seed=s) for s in (7, 7, 8)]
    seqs = []
    for gen in gens:
        state = SamplingState.create(gen)
        seqs.append([sample(gen, x, [], [], state).token_id for _ in range(40)])
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


@pytest.mark.parametrize("case", ["ties", "nan", "inf", "all_neg_inf", "strided", "bf16"])
def test_argmax_is_torchs(case):
    """The greedy fast path (numpy's argmax) picks what torch.argmax picks: the first of tied maxima, a NaN."""
    x = torch.tensor([1.0, 3.0, -2.0, 3.0, 0.5, 3.0])
    if case == "nan":
        x[4] = float("nan")
    elif case == "inf":
        x[2] = x[5] = float("inf")
    elif case == "all_neg_inf":
        x = torch.full((7,), NEG_INF)
    elif case == "strided":
        x = torch.stack([x, -x], 1)[:, 1]
    elif case == "bf16":
        x = x.bfloat16()
    assert argmax(x) == int(torch.argmax(x)) == {"nan": 4, "inf": 2, "all_neg_inf": 0, "strided": 2}.get(case, 1)


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


def test_batch_rows_equal_rows_alone():
    """Rows never mix: plain greedy rows (no penalties, logprobs or masked EOS) beside others, ties, a masked EOS
    and seeded draws (each from its own generator) give in one batch what each gives alone."""
    vocab, n = 50, 6
    logits = torch.stack([rand_logits(vocab, 100 + i) for i in range(n)])
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1          # a tie: the first index wins
    cfgs = [dict(top_k=1), dict(top_k=1, repetition_penalty=1.3), dict(do_sample=False),
            dict(top_k=1, logprobs=True, top_logprobs=2), dict(top_k=5, temperature=0.7, seed=3),
            dict(top_k=1, min_length=10, eos_token_ids=(int(logits[5].argmax()),))]
    histories = [([1, 2, 3], [3]) for _ in range(n)]

    def states():
        return [SamplingState.create(GenerationConfig(**c)) for c in cfgs]
    batched = Sampler("cpu").sample_rows(logits.clone(), [(st, a, o) for st, (a, o) in zip(states(), histories)])
    alone = [sample(st.gen, logits[i], *histories[i], state=st) for i, st in enumerate(states())]
    assert [r.token_id for r in batched] == [r.token_id for r in alone]
    assert [r.logprob for r in batched] == [r.logprob for r in alone]
    assert [r.top_logprobs for r in batched] == [r.top_logprobs for r in alone]
    assert batched[2].token_id == 7
    assert batched[5].token_id != int(logits[5].argmax())      # its EOS is masked until min_length
