"""The host sampler's whole chain (penalties, min_length, temperature, top_k, top_p in the documented order): the
distribution handed to the draw, exactly and by counting draws, seeded draws, greedy as the argmax of the processed
logits, logprobs of the raw logits, and batched rows equal to rows alone; each stage alone: test_sampler_units.py.
"""
from __future__ import annotations

import pytest
import torch
from sampler_cases import NEG_INF, SEEDS, rand_logits, reference_processed, sample

from allspark_client.config import GenerationConfig
from allspark_server.runner.sampler import Sampler, SamplingState, argmax

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
