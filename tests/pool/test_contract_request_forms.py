"""The contract suite, bad and unusual requests: refused generation configs, prompts and lengths (each with a status
that names the culprit, the engine still serving), integers beyond int64, numpy scalars and DashInfer's config
builder, and the per-thread last error, on the in-process `Engine` and on a 2-rank pool's `ClientEngine`.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
from contract_helpers import (
    ENGINE_MAX_LENGTH,
    EXCEED,
    GREEDY,
    HANG_S,
    NAME,
    OK,
    PARAM,
    PROBE,
    PROMPTS,
    SAMPLING,
    VOCAB,
    S,
    assert_serves,
    in_process_reference,
    own_model_cfg,
    refused,
    run,
)
from helpers import collect, hf_ref, random_prompt

from allspark_client import AsStatus

BAD_GEN = [
    ({"foo_bar": 1}, "foo_bar"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_logprobs": 11}, "top_logprobs"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, VOCAB]}, "eos_token_id"),
    ({"stop_words_ids": [[3], [VOCAB + 5]]}, "stop_words_ids"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
]


def test_bad_generation_config(api):
    engine, _, hf = api
    for gen, key in BAD_GEN:
        refused(engine, {"input_ids": PROBE}, dict(gen, max_new_tokens=4), PARAM, key)
    assert_serves(engine, hf)


def test_bad_prompts_and_lengths(api):
    engine, _, hf = api
    gen = dict(GREEDY, max_new_tokens=4)
    for empty in ([], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.long)):
        refused(engine, {"input_ids": empty}, gen, AsStatus.ALLSPARK_EMPTY_REQUEST, "empty")
    refused(engine, {"input_ids": [5, VOCAB, 6]}, gen, PARAM, "input_ids", str(VOCAB))
    refused(engine, {"input_ids": [5, -1]}, gen, PARAM, "input_ids")
    refused(engine, {"ids": [5]}, gen, PARAM, "input_ids")
    too_long = random_prompt(ENGINE_MAX_LENGTH + 1, seed=7601)
    refused(engine, {"input_ids": too_long}, {"top_k": 1}, EXCEED, str(ENGINE_MAX_LENGTH + 1))
    refused(engine, {"input_ids": PROBE}, dict(GREEDY, max_length=ENGINE_MAX_LENGTH + 1), EXCEED,
            "max_length", str(ENGINE_MAX_LENGTH))
    refused(engine, {"input_ids": PROBE}, dict(GREEDY, max_length=len(PROBE)), EXCEED, "max_length")
    # exactly engine_max_length is fine
    tokens = run(engine, PROBE, dict(GREEDY, max_length=ENGINE_MAX_LENGTH, max_new_tokens=3))[0]
    assert tokens == hf_ref(hf, PROBE, 8)[:3]
    assert_serves(engine, hf)


def outcome(engine, gen, key: str):
    """('OK', tokens) or (status, None); a refusal must name `key`. Raises if start_request raises."""
    status, handle, queue = engine.start_request(NAME, {"input_ids": PROBE}, gen)
    if status != OK:
        assert handle is None and key in engine.get_last_error(), (status, engine.get_last_error())
        return status.name, None
    try:
        tokens, _, final = collect(queue, HANG_S)
    finally:
        assert engine.release_request(NAME, handle) == OK
    assert final == S.GenerateFinished
    return "OK", tokens


def test_huge_integers_get_a_status(api, request):
    """Integers beyond int64 in the generation config get the same answer (a status) from both engines,
    never an exception."""
    engine, _, hf = api
    huge = 2**70
    cases = [("max_length", dict(GREEDY, max_length=huge)),
             ("max_new_tokens", dict(GREEDY, max_new_tokens=huge, max_length=len(PROBE) + 5)),
             ("min_length", dict(GREEDY, min_length=huge, max_new_tokens=5)),
             ("top_k", dict(SAMPLING, top_k=huge, seed=5))]
    in_process, _ = request.getfixturevalue("served_llama")
    for key, gen in cases:
        ours = outcome(engine, gen, key)
        assert ours == outcome(in_process, gen, key), key
        if ours[0] == "OK":         # accepted: an unreachable limit / a top_k beyond the vocabulary is off
            expected = (in_process_reference(request, PROBE, dict(gen, top_k=0)) if key == "top_k"
                        else hf_ref(hf, PROBE, 8)[:5])
            assert ours[1] == expected, key
        elif key == "max_length":
            assert ours[0] in ("ALLSPARK_EXCEED_LIMIT_ERROR", "ALLSPARK_PARAM_ERROR")


def test_config_forms_numpy_scalars_and_builder(api):
    engine, loader, hf = api
    prompt = PROMPTS[0]
    gen = {"top_k": np.int64(1), "max_new_tokens": np.int32(6), "temperature": np.float32(0.5),
           "eos_token_id": np.int64(VOCAB - 1)}
    ref6 = hf_ref(hf, prompt, 6)
    assert run(engine, prompt, gen)[0] == (ref6[:ref6.index(VOCAB - 1) + 1] if VOCAB - 1 in ref6 else ref6)
    # DashInfer's builder, filled from the model: eos 1, max_length from the runtime config
    builder = loader.create_reference_generation_config_builder(own_model_cfg(loader, "unused"))
    builder.update({"top_k": 1, "max_new_tokens": 24})
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, builder)
    assert status == OK, engine.get_last_error()
    try:
        tokens, _, final = collect(queue, HANG_S)
    finally:
        assert engine.release_request(NAME, handle) == OK
    ref = hf_ref(hf, prompt, 24)
    assert final == S.GenerateFinished and tokens == ref[:len(tokens)]
    assert len(tokens) == 24 or (tokens[-1] == 1 and 1 not in tokens[:-1])
    # the inert DashInfer keys with their "off" values are accepted
    inert = dict(GREEDY, max_new_tokens=3, num_beams=1, num_return_sequences=1, no_repeat_ngram_size=0,
                 bad_words_ids=[], lora_name="", early_stopping=True, length_penalty=1.0)
    assert run(engine, prompt, inert)[0] == ref[:3]


def test_last_error_is_per_thread_and_text_must_be_str(api):
    engine, loader, hf = api
    refused(engine, {"input_ids": PROBE}, {"main_thread_marker": 1}, PARAM, "main_thread_marker")
    other = []

    def in_other_thread():
        st, handle, _ = engine.start_request(NAME, {"input_ids": PROBE}, {"other_thread_marker": 1})
        other.append((st, engine.get_last_error()))
        if st == OK:
            engine.release_request(NAME, handle)

    t = threading.Thread(target=in_other_thread)
    t.start()
    t.join(HANG_S)
    assert other and other[0][0] == PARAM and "other_thread_marker" in other[0][1]
    assert "main_thread_marker" in engine.get_last_error()
    st, handle, queue = engine.start_request_text(NAME, loader, [5, 6, 7], GREEDY)
    assert (st, handle, queue) == (PARAM, None, None) and "str" in engine.get_last_error()
    assert_serves(engine, hf)
