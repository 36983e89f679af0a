"""Speculative sampling keeps the model's distribution (speculative/speculation.py): each verify row is sampled like
a one-token step and kept while it equals the proposal. Checked by chi-square against the softmax of the rows'
logits on a small vocabulary, for the host's seeded draws; and a wrong rule (on a mismatch, draw again from the
whole distribution) is shown to fail the same test. With a GPU's counter-based draws (keyed by the output position)
speculation emits exactly the tokens of one-token steps, seed for seed."""
from __future__ import annotations

import torch

from allspark_client.generation_config import GenerationConfig
from allspark_server.runner.draws import gumbel_draws
from allspark_server.runner.sample_types import SamplingState
from allspark_server.runner.sampler import Sampler
from allspark_server.speculative.ngram import propose_ngram
from allspark_server.speculative.speculation import NgramProposer, Speculation

VOCAB = 6
DRAFT = (2, 3)
TRIALS = 12000
P_REJECT = 1e-4          # a right rule fails one run in 10 000


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(a statistic this large | counts ~ multinomial(probs)), by the chi-square law (df = cells - 1) over the
    cells of nonzero probability; 0 when a cell of probability 0 has a count."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    n = counts.sum()
    expected = probs.double() * n
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def verify_rows(logits: torch.Tensor, gen: GenerationConfig, seeds: range, sampler: Sampler):
    """For each seed, a request's verify step of DRAFT: the sampled results of its 1 + len(DRAFT) rows."""
    rows, per = [], len(DRAFT) + 1
    for seed in seeds:
        state = SamplingState.create(GenerationConfig(**{**gen.__dict__, "seed": seed}))
        for i in range(per):
            rows.append((state, [1] + list(DRAFT[:i]), list(DRAFT[:i])))
    results = sampler.sample_rows(logits.repeat(len(seeds), 1), rows)
    return [results[j * per:(j + 1) * per] for j in range(len(seeds))]


def right_rule(rows):
    return Speculation(len(DRAFT), NgramProposer(1, 1)).accepted(DRAFT, rows)


def wrong_rule(rows, rng=torch.Generator().manual_seed(7), logits=None):
    """Accept the proposal with the row's probability of it; on a rejection draw again from the whole row (the
    proposed token included): that token comes out too often."""
    out = []
    for i, d in enumerate(DRAFT):
        p = torch.softmax(logits[i], -1)
        if torch.rand(1, generator=rng).item() < p[d]:
            out.append(d)
            continue
        out.append(int(torch.multinomial(p, 1, generator=rng)))
        return out
    return out + [rows[len(DRAFT)].token_id]


def emitted_distributions(rule, logits, gen):
    """Counts of the first emitted token, and of the second among runs whose first was DRAFT[0]."""
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    sampler = Sampler("cpu")
    for block in range(0, TRIALS, 2000):
        for rows in verify_rows(logits, gen, range(block, block + 2000), sampler):
            tokens = [r if isinstance(r, int) else r.token_id for r in rule(rows)]
            first[tokens[0]] += 1
            if tokens[0] == DRAFT[0] and len(tokens) > 1:
                second[tokens[1]] += 1
    return first, second


def target(logits: torch.Tensor, gen: GenerationConfig, row: int) -> torch.Tensor:
    x = logits[row] / gen.temperature
    if gen.top_k:
        x = x.masked_fill(x < torch.topk(x, gen.top_k).values[-1], float("-inf"))
    return torch.softmax(x.double(), -1)


LOGITS = torch.tensor([[0.3, -0.2, 1.1, 0.4, -1.0, 0.0],     # row 0: after the known token
                       [0.1, 0.9, -0.3, 1.2, 0.2, -0.5],     # row 1: after DRAFT[0]
                       [0.0, 0.5, 0.5, -0.7, 1.0, 0.2]])     # row 2: after both


def test_emitted_tokens_follow_the_models_distribution():
    for gen in (GenerationConfig(temperature=1.0), GenerationConfig(temperature=0.7, top_k=4)):
        first, second = emitted_distributions(right_rule, LOGITS, gen)
        p_first = chi2_p_value(first, target(LOGITS, gen, 0))
        p_second = chi2_p_value(second, target(LOGITS, gen, 1))
        assert p_first > P_REJECT and p_second > P_REJECT, (gen, first, second, p_first, p_second)
        assert second.sum() > 0.2 * TRIALS     # the second row was reached often enough to be tested


def test_a_wrong_acceptance_rule_fails_the_same_test():
    gen = GenerationConfig(temperature=1.0)
    first, _ = emitted_distributions(lambda rows: wrong_rule(rows, logits=LOGITS), LOGITS, gen)
    assert chi2_p_value(first, target(LOGITS, gen, 0)) < P_REJECT, first


def fake_logits(context: list[int]) -> torch.Tensor:
    """A deterministic 'model': logits that depend on the whole context, peaked so that runs repeat."""
    g = torch.Generator().manual_seed(hash(tuple(context[-3:])) & 0xFFFFFFFF)
    return torch.randn(VOCAB, generator=g) * 3.0


def test_counter_based_draws_emit_the_tokens_of_one_token_steps():
    sampler = Sampler("cpu", draw=gumbel_draws)
    gen = GenerationConfig(temperature=0.8, seed=1234)
    prompt = [1, 2, 3, 1, 2]
    state = SamplingState.create(gen)

    plain = []
    while len(plain) < 60:
        ids = prompt + plain
        plain.append(sampler.sample_rows(fake_logits(ids)[None], [(state, ids, list(plain))])[0].token_id)

    spec, speculation, verified = [], Speculation(3, NgramProposer(1, 2)), 0
    while len(spec) < 60:
        ids = prompt + spec
        draft = propose_ngram(ids, 3, 1, 2)
        contexts = [ids + draft[:i] for i in range(len(draft) + 1)]
        rows = [(state, c, c[len(prompt):]) for c in contexts]
        results = sampler.sample_rows(torch.stack([fake_logits(c) for c in contexts]), rows)
        emitted = speculation.accepted(draft, results) if draft else results
        verified += bool(draft)
        spec.extend(r.token_id for r in emitted)
    assert spec[:60] == plain and verified > 5, (spec, plain)
    assert speculation.stats.accepted_tokens > 0


class AlwaysSeven(NgramProposer):
    """Proposes token 7 whenever asked."""

    def propose(self, requests, counts):
        return [[7] * k for k in counts]


def test_a_request_whose_proposals_are_rejected_backs_off_until_one_is_accepted():
    from types import SimpleNamespace

    from allspark_server.runner.sample_types import SampleResult
    from allspark_server.speculative.speculation import MAX_BACKOFF

    speculation = Speculation(2, AlwaysSeven(1, 1))
    req = SimpleNamespace(request_id=5, num_tokens=10, num_computed_tokens=9, max_length=1000)
    entry = SimpleNamespace(sampling=SimpleNamespace(gen=GenerationConfig(), guided=None))
    proposed_at = []
    for step in range(60):
        drafts = speculation.propose([req], lambda rid: entry)
        if drafts:
            proposed_at.append(step)
            sampled = 7 if step == 36 else 3               # the proposal at step 36 has its first token accepted
            rows = [SampleResult(sampled), SampleResult(3), SampleResult(3)]
            speculation.accepted(drafts[5], rows, 5)
    # waits of 1, 2, 4, 8, 16 steps after each whole rejection; the accepted token ends the back-off
    assert MAX_BACKOFF == 16
    assert proposed_at == [0, 2, 5, 10, 19, 36, 37, 39, 42, 47, 56], proposed_at
    # the overlapped GPU loop plans a step ahead only while every request of it waits, and counts that step
    assert not speculation.wait_out_next([5, 6])       # request 6 has no back-off: it may get a proposal
    waited = 0
    while speculation.wait_out_next([5]):
        waited += 1
    assert waited == 16 - 3 and speculation.propose([req], lambda rid: entry) == {5: [7, 7]}
    speculation.forget(5)
    assert not speculation.wait_out_next([5])
    assert speculation.propose([req], lambda rid: entry) == {5: [7, 7]}
    # a request for which the proposer finds nothing backs off the same way
    asked = []

    class Nothing(NgramProposer):
        def propose(self, requests, counts):
            asked.append(step)
            return [[] for _ in requests]

    lookup = Speculation(2, Nothing(1, 1))
    for step in range(40):
        assert lookup.propose([req], lambda rid: entry) == {}
    assert asked == [0, 2, 5, 10, 19, 36], asked


def test_no_proposals_while_prompt_rows_may_join_the_step():
    """A verify step computes every row as a one-row step would: prompt rows beside it would all go to the GEMV."""
    from types import SimpleNamespace

    speculation = Speculation(2, AlwaysSeven(1, 1))
    entry = SimpleNamespace(sampling=SimpleNamespace(gen=GenerationConfig(), guided=None))
    decoding = SimpleNamespace(request_id=5, num_tokens=10, num_computed_tokens=9, max_length=1000)
    prefilling = SimpleNamespace(request_id=6, num_tokens=40, num_computed_tokens=16, max_length=1000)
    assert speculation.propose([decoding, prefilling], lambda rid: entry) == {}
    assert speculation.propose([decoding], lambda rid: entry, prompts_waiting=True) == {}
    assert speculation.propose([decoding], lambda rid: entry) == {5: [7, 7]}
