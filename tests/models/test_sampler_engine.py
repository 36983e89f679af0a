"""Sampler semantics at the engine level: seeds, logprobs, rejected generation configs, and penalties /
min_length on the served Llama against the HF fp32 model run step by step.
"""
from __future__ import annotations

import pytest
import torch
from helpers import collect, generate, hf_apply, hf_logits, hf_loop, presence_frequency_ref, random_prompt
from transformers import MinLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from allspark_client import AsStatus, GenerateRequestStatus

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
    ref = torch.log_softmax(hf_logits(llama.model, prompt + tokens[:-1]), -1)[len(prompt) - 1:]
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
    ref = torch.log_softmax(hf_logits(llama.model, prompt + tokens[:-1]), -1)[len(prompt) - 1:]
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
# 4. penalties and min_length at engine level vs HF reference loops (run on float32 logits)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_seed", [41, 42])
def test_engine_repetition_penalty_matches_hf_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(10, prompt_seed)
    ref = hf_loop(llama.model, prompt, 24,
                  lambda ids, out, lg: hf_apply(RepetitionPenaltyLogitsProcessor(1.3), ids, lg), dtype=torch.float32)
    plain = hf_loop(llama.model, prompt, 24, lambda ids, out, lg: lg, dtype=torch.float32)
    assert ref != plain, "penalty should change this greedy continuation"
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 24,
                                                   "eos_token_id": []})
    assert tokens == ref


@pytest.mark.parametrize("prompt_seed", [43, 44])
def test_engine_presence_frequency_match_float64_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(10, prompt_seed)
    ref = hf_loop(llama.model, prompt, 24,
                  lambda ids, out, lg: presence_frequency_ref(lg, out, 0.5, 0.3), dtype=torch.float32)
    plain = hf_loop(llama.model, prompt, 24, lambda ids, out, lg: lg, dtype=torch.float32)
    assert ref != plain, "penalties should change this greedy continuation"
    tokens, _ = generate(engine, "llama", prompt, {"do_sample": False, "presence_penalty": 0.5,
                                                   "frequency_penalty": 0.3, "max_new_tokens": 24,
                                                   "eos_token_id": []})
    assert tokens == ref


@pytest.mark.parametrize("prompt_seed", [45, 46])
def test_engine_min_length_matches_hf_loop(served_llama, llama, prompt_seed):
    engine, _ = served_llama
    prompt = random_prompt(8, prompt_seed)
    first = int(torch.argmax(hf_logits(llama.model, prompt)[-1]))
    eos = (first,)
    min_length = len(prompt) + 5
    # without min_length the request ends at once on its (forced) EOS
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first]})
    assert tokens == [first]
    ref = hf_loop(llama.model, prompt, 16,
                  lambda ids, out, lg: hf_apply(MinLengthLogitsProcessor(min_length, [first]), ids, lg),
                  eos=eos, dtype=torch.float32)
    tokens, _ = generate(engine, "llama", prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first],
                                                   "min_length": min_length})
    assert first not in tokens[:5]
    assert len(tokens) >= 5
    assert tokens == ref
