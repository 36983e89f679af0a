"""The contract suite, generation: streaming, sampling parameters, lengths / EOS / stop words and logprobs, on the
in-process `Engine` and on a 2-rank pool's `ClientEngine`; bad and unusual requests: test_contract_request_forms.py;
the request and model lifecycle: test_contract_lifecycle.py.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from contract_helpers import (
    GREEDY,
    HANG_S,
    NAME,
    OK,
    PARAM,
    PROMPTS,
    SAMPLING,
    VOCAB,
    S,
    assert_serves,
    in_process_reference,
    run,
)
from helpers import RecordingQueue, collect, hf_logits, hf_loop, hf_ref, random_prompt

import allspark_client.client as client_module
import allspark_server.engine.engine as engine_module

# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["list", "numpy", "torch_1d", "torch_2d", "ids", "text"])
def test_greedy_stream_matches_hf(api, form):
    engine, loader, hf = api
    gen = dict(GREEDY, max_new_tokens=48)
    if form == "text":
        cases = ["Hello world! The quick brown fox", "Once upon a time there was"]
        prompts = [loader.get_tokenizer().encode(t) for t in cases]
    else:
        cases = prompts = PROMPTS
    for case, prompt in zip(cases, prompts):
        if form == "text":
            status, handle, queue = engine.start_request_text(NAME, loader, case, gen)
        elif form == "ids":
            status, handle, queue = engine.start_request_ids(NAME, loader, prompt, gen)
        else:
            ids = {"list": list, "numpy": np.array, "torch_1d": torch.tensor,
                   "torch_2d": lambda p: torch.tensor([p])}[form](prompt)
            status, handle, queue = engine.start_request(NAME, {"input_ids": ids}, gen)
        assert status == OK, engine.get_last_error()
        try:
            tokens, _, final = collect(queue, HANG_S)
        finally:
            assert engine.release_request(NAME, handle) == OK
        assert final == S.GenerateFinished
        assert tokens == hf_ref(hf, prompt, 48), (form, case)


def test_status_sequence_and_stat_info(api, monkeypatch):
    engine, _, hf = api
    monkeypatch.setattr(engine_module, "ResultQueue", RecordingQueue)
    monkeypatch.setattr(client_module, "ResultQueue", RecordingQueue)
    prompt = PROMPTS[1]
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=48))
    assert status == OK and isinstance(queue, RecordingQueue)
    seen = []
    try:
        tokens = []
        while (el := queue.Get()) is not None:
            tokens.extend(el.ids_from_generate)
            seen.append(queue.GenerateStatus())
            assert queue.GeneratedLength() >= len(tokens)
    finally:
        assert engine.release_request(NAME, handle) == OK
    assert tokens == hf_ref(hf, prompt, 48)
    assert queue.GenerateStatus() == S.GenerateFinished and queue.GeneratedLength() == 48
    # strictly forward through Init -> ContextFinished -> Generating -> GenerateFinished
    h = queue.history
    assert h[0] == S.Init and h[-1] == S.GenerateFinished and h == sorted(set(h)), h
    assert set(h) <= {S.Init, S.ContextFinished, S.Generating, S.GenerateFinished}, h
    assert S.Generating in h or S.ContextFinished in h, h
    assert all(s in (S.ContextFinished, S.Generating, S.GenerateFinished) for s in seen), seen
    # after the end: nothing more, and no blocking
    assert queue.Get() is None and queue.GetNoWait() is None and queue.GetWithTimeout(10_000) is None
    info = queue.RequestStatInfo()
    assert info["context_token_length"] == len(prompt) and info["generated_token_length"] == 48
    assert 0 < info["arrival_time"] <= info["first_token_time"] <= info["last_token_time"] <= info["finished_time"]
    assert info["time_to_first_token"] == info["first_token_time"] - info["arrival_time"]


def test_get_no_wait_and_with_timeout(api):
    engine, _, hf = api
    prompt = PROMPTS[0]
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=20))
    assert status == OK
    try:
        first = queue.GetWithTimeout(int(HANG_S * 1000))
        assert first is not None and len(first.ids_from_generate) >= 1
        assert engine.sync_request(NAME, handle) == OK
        assert queue.GenerateStatus() == S.GenerateFinished and queue.GeneratedLength() == 20
        rest = queue.GetNoWait()            # everything since the last call, in one piece
        tokens = first.ids_from_generate + (rest.ids_from_generate if rest is not None else [])
        assert tokens == hf_ref(hf, prompt, 20)
        assert queue.GetNoWait() is None and queue.GetWithTimeout(10_000) is None and queue.Get() is None
    finally:
        assert engine.release_request(NAME, handle) == OK


# ------------------------------------------------------------------------------------------------
# sampling parameters
# ------------------------------------------------------------------------------------------------

def test_seed_reproducible(api, request):
    engine, _, _ = api
    prompt = random_prompt(12, seed=7201)
    a = run(engine, prompt, dict(SAMPLING, seed=1))[0]
    b = run(engine, prompt, dict(SAMPLING, seed=1))[0]
    c = run(engine, prompt, dict(SAMPLING, seed=2))[0]
    assert len(a) == 24 and a == b and a != c
    # the same seeds, concurrently in one batch: the same streams
    started = [engine.start_request(NAME, {"input_ids": prompt}, dict(SAMPLING, seed=s)) for s in (1, 2, 1)]
    try:
        assert all(st == OK for st, _, _ in started), engine.get_last_error()
        outs = [collect(q, HANG_S)[0] for _, _, q in started]
    finally:
        for st, h, _ in started:
            if st == OK:
                assert engine.release_request(NAME, h) == OK
    assert outs == [a, c, a]
    assert a == in_process_reference(request, prompt, dict(SAMPLING, seed=1))


def _choices(engine, prompt, gen, n):
    status, started = engine.start_choices(NAME, {"input_ids": prompt}, gen, n)
    assert status == OK and len(started) == n, engine.get_last_error()
    try:
        return [collect(q, HANG_S)[0] for _, q in started]
    finally:
        for handle, _ in started:
            assert engine.release_request(NAME, handle) == OK


def test_choices_compute_the_prompt_once_and_draw_their_own_seeds(api, request):
    engine, _, hf = api
    # 70 tokens: 64 of them in full spans at every span size below 128, so the count below does not depend on it
    prompt = random_prompt(70, seed=7202)
    before = engine.get_as_engine_stat(NAME)
    outs = _choices(engine, prompt, dict(GREEDY, max_new_tokens=12), 3)
    after = engine.get_as_engine_stat(NAME)
    assert outs == [hf_ref(hf, prompt, 12)] * 3
    # the first choice computes all 70 tokens; the others take its 64 from the cache and compute the last 6
    assert after.prefix_cache_hit_token - before.prefix_cache_hit_token == 2 * 64
    assert after.prefix_cache_miss_token - before.prefix_cache_miss_token == 70 + 2 * 6
    seeded = _choices(engine, prompt[:12], dict(SAMPLING, seed=11), 3)
    assert seeded == _choices(engine, prompt[:12], dict(SAMPLING, seed=11), 3)     # reproducible as a set
    assert len({tuple(t) for t in seeded}) == 3                                   # each choice its own draws
    assert seeded[0] == in_process_reference(request, prompt[:12], dict(SAMPLING, seed=11))   # choice 0: the seed
    for bad in (0, -1, 129, 2.0, True):
        status, started = engine.start_choices(NAME, {"input_ids": prompt}, GREEDY, bad)
        assert status == PARAM and started == [] and "n must be" in engine.get_last_error()
    status, started = engine.start_choices(NAME, {"input_ids": [VOCAB + 5]}, GREEDY, 2)   # nothing left started
    assert status == PARAM and started == []
    assert_serves(engine, hf)


EOS_HALF = list(range(0, VOCAB, 2))        # every even token ends the request (unless min_length forbids it)


PENALTY_CASES = {       # name: (the case's keys, the keys of its baseline without the parameter under test)
    "repetition": ({"repetition_penalty": 1.3}, {}),
    "presence_frequency": ({"presence_penalty": 0.5, "frequency_penalty": 0.3}, {}),
    "min_length": ({"min_length": 20, "eos_token_id": EOS_HALF}, {"eos_token_id": EOS_HALF}),
    "all": ({"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 0.7, "min_length": 16,
             "eos_token_id": EOS_HALF}, {"eos_token_id": EOS_HALF}),
}


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_sampled_penalties_same_on_both_engines(api, request, case):
    """Sampled (seeded) with penalties / min_length: the pool draws exactly what the Engine draws."""
    engine, _, _ = api
    prompt = random_prompt(10, seed=7301)
    keys, base_keys = PENALTY_CASES[case]
    gen = dict(SAMPLING, seed=11, **keys)
    ours = run(engine, prompt, gen)[0]
    assert ours == in_process_reference(request, prompt, gen)
    assert ours == run(engine, prompt, gen)[0]                    # and the same again
    assert ours != run(engine, prompt, dict(SAMPLING, seed=11, **base_keys))[0], "the keys should change the draw"
    if "min_length" in keys:        # no EOS before min_length (prompt 10 + 10 or 6 outputs), then the first ends it
        free = keys["min_length"] - len(prompt)
        assert len(ours) >= free and not any(t % 2 == 0 for t in ours[:free - 1])
        assert len(ours) == 24 or (ours[-1] % 2 == 0 and not any(t % 2 == 0 for t in ours[:-1]))
    else:
        assert len(ours) == 24


def test_greedy_repetition_penalty_matches_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=41)

    def rep(ids, out, lg, p=1.3):
        lg = lg.clone()
        seen = torch.tensor(sorted(set(ids)))
        vals = lg[seen]
        lg[seen] = torch.where(vals > 0, vals / p, vals * p)
        return lg

    ref = hf_loop(hf, prompt, 24, rep)
    assert ref != hf_ref(hf, prompt, 24)
    assert run(engine, prompt, dict(GREEDY, repetition_penalty=1.3, max_new_tokens=24))[0] == ref


def test_greedy_presence_frequency_match_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=43)

    def pf(ids, out, lg):
        lg = lg.clone()
        for tok, count in Counter(out).items():
            lg[tok] -= 0.3 * count + 0.5
        return lg

    ref = hf_loop(hf, prompt, 24, pf)
    assert ref != hf_ref(hf, prompt, 24)
    tokens = run(engine, prompt, {"do_sample": False, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                  "max_new_tokens": 24, "eos_token_id": []})[0]
    assert tokens == ref


def test_logit_bias_matches_hf_loop_and_bans(api, request):
    """Greedy with a bias: transformers' greedy loop over logits + bias; seeded sampling with -100 on the tokens an
    unbiased run drew: none of them again, and the pool draws what the Engine draws; +100 forces its token."""
    engine, _, hf = api
    prompt = random_prompt(10, seed=47)
    plain = hf_ref(hf, prompt, 16)
    bias = {plain[0]: -100.0, plain[3]: 2.0, 77: 1.5}

    def biased(ids, out, lg):
        lg = lg.clone()
        for tok, b in bias.items():
            lg[tok] += b
        return lg

    ref = hf_loop(hf, prompt, 16, biased)
    assert ref != plain
    assert run(engine, prompt, dict(GREEDY, max_new_tokens=16, logit_bias=bias))[0] == ref
    drawn = run(engine, prompt, dict(SAMPLING, seed=13))[0]
    gen = dict(SAMPLING, seed=13, logit_bias={t: -100 for t in drawn})
    ours = run(engine, prompt, gen)[0]
    assert len(ours) == len(drawn) and not set(ours) & set(drawn)
    assert ours == in_process_reference(request, prompt, gen)
    assert run(engine, prompt, dict(SAMPLING, seed=13, logit_bias={321: 100}))[0] == [321] * len(drawn)


def test_min_length_matches_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(8, seed=45)
    first = int(torch.argmax(hf_logits(hf, prompt)[-1]))
    # without min_length the request ends at once on its EOS (included in the output)
    assert run(engine, prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first]})[0] == [first]
    min_length = len(prompt) + 5

    def mask(ids, out, lg):
        lg = lg.clone()
        if len(ids) < min_length:
            lg[first] = float("-inf")
        return lg

    ref = hf_loop(hf, prompt, 16, mask, eos=(first,))
    tokens = run(engine, prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first],
                                  "min_length": min_length})[0]
    assert first not in tokens[:5] and tokens == ref


def test_eos_stop_words_and_lengths(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=6)
    ref = hf_ref(hf, prompt, 20)
    # max_length is the total (prompt + output): 10 + 5
    assert run(engine, prompt, dict(GREEDY, max_length=15))[0] == ref[:5]
    # the tighter of max_length / max_new_tokens wins, either way round
    assert run(engine, prompt, dict(GREEDY, max_length=200, max_new_tokens=4))[0] == ref[:4]
    assert run(engine, prompt, dict(GREEDY, max_length=13, max_new_tokens=10))[0] == ref[:3]
    # eos: stops at (and includes) the first occurrence of any eos id
    eos = ref[6]
    out = run(engine, prompt, dict(GREEDY, max_new_tokens=20, eos_token_id=[eos, 3]))[0]
    stop = min(i for i, t in enumerate(ref) if t in (eos, 3))
    assert out == ref[:stop + 1]
    # an int eos is accepted too
    assert run(engine, prompt, dict(GREEDY, max_new_tokens=20, eos_token_id=eos))[0] == out
    # stop words: the output ends with the matched sequence
    seq = ref[8:10]
    stop_at = next(i for i in range(1, 20) if ref[i - 1:i + 1] == seq)
    out = run(engine, prompt, dict(GREEDY, max_new_tokens=20, stop_words_ids=[[511, 510], seq]))[0]
    assert out == ref[:stop_at + 1]


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------

def test_logprobs_match_hf(api):
    engine, _, hf = api
    prompt = random_prompt(9, seed=31)
    n = 16
    tokens, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=n, logprobs=True, top_logprobs=5))
    assert tokens == hf_ref(hf, prompt, n)
    token_lp, top_lp = [], []
    for el in elements:
        assert len(el.token_logprobs_list) == len(el.ids_from_generate) == len(el.log_probs_list)
        token_lp.extend(el.token_logprobs_list)
        top_lp.extend(el.log_probs_list)
    ref = torch.log_softmax(hf_logits(hf, prompt + tokens[:-1]), -1)[len(prompt) - 1:]      # [n, V]
    for i, tok in enumerate(tokens):
        assert token_lp[i] == pytest.approx(float(ref[i, tok]), abs=1e-4)
        pairs = top_lp[i]
        assert len(pairs) == 5 and all(isinstance(t, int) and isinstance(v, float) for t, v in pairs)
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        assert pairs[0][0] == tok
        hf_top = torch.topk(ref[i], 5)
        assert [t for t, _ in pairs] == hf_top.indices.tolist()
        assert values == pytest.approx(hf_top.values.tolist(), abs=1e-4)
    # logprobs without top_logprobs: the chosen token's logprob, empty top lists
    tokens3, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=3, logprobs=True))
    assert tokens3 == tokens[:3]
    assert [lp for el in elements for lp in el.token_logprobs_list] == pytest.approx(token_lp[:3], abs=1e-6)
    assert [x for el in elements for x in el.log_probs_list] == [[]] * 3
    # logprobs off: nothing reported
    _, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=3))
    assert all(el.token_logprobs_list == [] and el.log_probs_list == [] for el in elements)
