"""logit_bias in the generation config and the sampler: bad values refused naming logit_bias; in a batch that mixes
rows with and without a bias, a biased greedy row takes the argmax of logits + bias (added by hand here), its
logprobs are the log-softmax of logits + bias (float64), unbiased rows are untouched, -100 bans a token from a long
run of draws with either draw and +100 forces one, and a row's result is the same alone and in the batch.
"""
from __future__ import annotations

import pytest
import torch

from allspark_client.config import GenerationConfig, parse_generation_config
from allspark_client.validation import ConfigError
from allspark_client.wire import generation_config_from_proto, generation_config_to_proto
from allspark_server.runner.draws import gumbel_draws
from allspark_server.runner.sampler import Sampler, SamplingState

SAMPLERS = {"host": Sampler("cpu"), "counter": Sampler("cpu", draw=gumbel_draws)}


@pytest.mark.parametrize("raw, needle", [
    ({"x": 1.0}, "logit_bias keys"),
    ({-1: 1.0}, "logit_bias keys"),
    ({50: 1.0}, "logit_bias keys must be token ids in [0, 50)"),
    ({True: 1.0}, "logit_bias keys"),
    ({3: 100.5}, "logit_bias[3] must be in [-100.0, 100.0]"),
    ({3: float("nan")}, "logit_bias[3]"),
    ({3: "1"}, "logit_bias[3] must be a number"),
    ([1, 2], "logit_bias must be a dict"),
    ({i: 1.0 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_refused(raw, needle):
    with pytest.raises(ConfigError) as e:
        parse_generation_config({"logit_bias": raw}, vocab_size=50 if needle.endswith("[0, 50)") else 1000)
    assert needle in str(e.value)


def test_logit_bias_parsed_sorted():
    gen = parse_generation_config({"logit_bias": {7: -100, 2: 0.5}}, vocab_size=10)
    assert gen.logit_bias == ((2, 0.5), (7, -100.0))
    assert parse_generation_config({"logit_bias": {}}).logit_bias == ()
    assert parse_generation_config({"logit_bias": None}).logit_bias == ()
    # through the pool's proto, both ways
    raw = {"logit_bias": {7: -100, 2: 0.5}}
    assert parse_generation_config(generation_config_from_proto(generation_config_to_proto(raw, gen))) == gen
    assert not generation_config_to_proto({}, GenerationConfig()).logit_bias


def _rows(cfgs):
    return [(SamplingState.create(GenerationConfig(**c)), [1, 2, 3], [3]) for c in cfgs]


@pytest.mark.parametrize("draw", sorted(SAMPLERS))
def test_mixed_batch_greedy_and_logprobs(draw):
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    raw_top = logits.argmax(-1).tolist()
    bias = {raw_top[0]: -100.0, 5: 2.5, 9: -1.0}
    cfgs = [dict(top_k=1, logit_bias=bias),                            # plain greedy with a bias
            dict(top_k=1),                                             # plain greedy, no bias
            dict(top_k=1, logit_bias={11: 100.0}, logprobs=True, top_logprobs=3),
            dict(top_k=1, logprobs=True, top_logprobs=2)]
    sampler = SAMPLERS[draw]
    got = sampler.sample_rows(logits.clone(), _rows(cfgs))
    biased = [logits[i].double().clone() for i in range(4)]
    for t, b in bias.items():
        biased[0][t] += b
    biased[2][11] += 100.0
    assert [r.token_id for r in got] == [int(biased[0].argmax()), raw_top[1], 11, raw_top[3]]
    assert got[0].token_id != raw_top[0]
    for i in (2, 3):
        ref = torch.log_softmax(biased[i], -1)
        assert got[i].logprob == pytest.approx(float(ref[got[i].token_id]), abs=1e-5)
        top = torch.topk(ref, cfgs[i]["top_logprobs"])
        assert [t for t, _ in got[i].top_logprobs] == top.indices.tolist()
        assert [v for _, v in got[i].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    for i in range(4):   # alone as in the batch
        alone = sampler.sample_rows(logits[i:i + 1].clone(), _rows([cfgs[i]]))[0]
        assert (alone.token_id, alone.logprob, alone.top_logprobs) == \
            (got[i].token_id, got[i].logprob, got[i].top_logprobs)
    # a greedy row with a penalty takes the chain: the bias still applies there
    pen = sampler.sample_rows(logits[:1].clone(), _rows([dict(top_k=1, logit_bias=bias, repetition_penalty=1.3)]))
    assert pen[0].token_id != raw_top[0]


@pytest.mark.parametrize("draw", sorted(SAMPLERS))
def test_sampled_bans_and_forces(draw):
    """Flat logits over 8 tokens: unbiased, every token comes out within 400 draws; -100 on four of them: none of
    them ever does; +100 on one: only it does."""
    vocab, steps = 8, 400
    logits = torch.zeros(3, vocab)
    banned = {0: -100.0, 2: -100.0, 5: -100.0, 7: -100.0}
    seen = [set(), set(), set()]
    states = [SamplingState.create(GenerationConfig(temperature=1.0, seed=3, logit_bias=b))
              for b in ({}, banned, {6: 100.0})]
    sampler = SAMPLERS[draw]
    for step in range(steps):
        rows = [(st, list(range(step)), list(range(step))) for st in states]
        for i, r in enumerate(sampler.sample_rows(logits.clone(), rows)):
            seen[i].add(r.token_id)
    assert seen[0] == set(range(vocab))
    assert seen[1] == set(range(vocab)) - set(banned)
    assert seen[2] == {6}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_logits_take_the_bias_as_the_host_does(dtype):
    """A GPU's sampler on CUDA logits: the counter draws' tokens on the host (fp32), the bias's bans and force."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    top = logits.float().argmax(-1).tolist()
    cfgs = [dict(top_k=1, logit_bias={top[0]: -100, 17: 5.0}), dict(top_k=1),
            dict(temperature=1.0, seed=2, logit_bias={top[2]: -100}),
            dict(temperature=0.7, seed=3, logit_bias={9: 100})]
    gpu = Sampler(torch.device("cuda")).sample_rows(logits.cuda(), _rows(cfgs))
    cpu = SAMPLERS["counter"].sample_rows(logits.clone(), _rows(cfgs))
    if dtype == torch.float32:    # bf16 draws may round apart; the bias's effects below hold either way
        assert [r.token_id for r in gpu] == [r.token_id for r in cpu]
    assert gpu[0].token_id == cpu[0].token_id != top[0] and gpu[1].token_id == top[1] and gpu[2].token_id != top[2]
    assert gpu[3].token_id == 9
