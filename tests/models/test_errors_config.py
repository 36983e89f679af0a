"""Error paths of the in-process Engine, request side: bad generation configs, bad and accepted inputs,
prompt / max_length limits and KV capacity. After each error the engine must still serve (see
errors_helpers.assert_still_serves)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from errors_helpers import (
    ENGINE_MAX_LENGTH,
    EXCEED,
    GOOD,
    HANG_S,
    MAIN,
    OK,
    PARAM,
    PROBE_PROMPT,
    assert_still_serves,
    start_fail,
)
from helpers import assert_same_tokens, collect, hf_ref, random_prompt, serialize, start_engine

from allspark_client import AsException, AsStatus, GenerateRequestStatus
from allspark_server import ASGenerationConfigBuilder

# ------------------------------------------------------------------------------------------------
# generation config
# ------------------------------------------------------------------------------------------------

BAD_GEN = [
    ({"foo_bar": 1}, "foo_bar"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"max_length": "10"}, "max_length"),
    ({"stop_words_ids": [1, 2]}, "stop_words_ids"),
    ({"stop_words_ids": [[1], [600]]}, "stop_words_ids"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": 99999}, "eos_token_id"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_logprobs": 11}, "top_logprobs"),
    ({"min_length": -1}, "min_length"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 1}, "logprobs"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"num_beams": 2}, "num_beams"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "{bad"}}, "response_format"),
]


@pytest.mark.parametrize("gen,key", BAD_GEN, ids=[f"{k}={list(g.values())[0]!r}" for g, k in BAD_GEN])
def test_bad_generation_config(srv, gen, key):
    start_fail(srv.engine, MAIN, {"input_ids": PROBE_PROMPT}, gen, PARAM, key)
    assert_still_serves(srv.engine, MAIN, srv.hf)


def test_generation_config_not_a_dict_and_via_builder(srv):
    start_fail(srv.engine, MAIN, {"input_ids": PROBE_PROMPT}, "top_k=1", PARAM, "generation config", "str")
    builder = ASGenerationConfigBuilder({"top_k": 1}).update({"bogus_builder_key": 3})
    start_fail(srv.engine, MAIN, {"input_ids": PROBE_PROMPT}, builder, PARAM, "bogus_builder_key")
    assert_still_serves(srv.engine, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    ("not_a_dict", lambda p, v: p, "inputs must be a dict"),
    ("no_input_ids", lambda p, v: {"ids": p}, "input_ids"),
    ("extra_key", lambda p, v: {"input_ids": p, "pixel_values": [1]}, "pixel_values"),
    ("string_ids", lambda p, v: {"input_ids": "1 2 3"}, "str"),
    ("float_ids", lambda p, v: {"input_ids": [1.0, 2.0]}, "1.0"),
    ("float_tensor", lambda p, v: {"input_ids": torch.tensor([5.0, 6.0])}, "5.0"),
    ("bool_ids", lambda p, v: {"input_ids": [True, 5]}, "True"),
    ("negative_id", lambda p, v: {"input_ids": [5, -1, 6]}, "-1"),
    ("id_ge_vocab", lambda p, v: {"input_ids": [5, v, 6]}, "in [0, {vocab}), found {vocab}"),
    ("batch_of_2", lambda p, v: {"input_ids": [p, p]}, "batch of 2"),
    ("batch_of_2_tensor", lambda p, v: {"input_ids": torch.tensor([p, p])}, "batch of 2"),
]


@pytest.mark.parametrize("case,make,mention", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(srv, case, make, mention):
    start_fail(srv.engine, MAIN, make(list(PROBE_PROMPT), srv.vocab), GOOD, PARAM, mention.format(vocab=srv.vocab))
    assert_still_serves(srv.engine, MAIN, srv.hf)


@pytest.mark.parametrize("empty", [[], [[]], (), torch.zeros((1, 0), dtype=torch.long),
                                   torch.zeros((0,), dtype=torch.long), np.array([], dtype=np.int64)],
                         ids=["list", "nested_list", "tuple", "torch_1x0", "torch_0", "numpy"])
def test_empty_prompt(srv, empty):
    start_fail(srv.engine, MAIN, {"input_ids": empty}, GOOD, AsStatus.ALLSPARK_EMPTY_REQUEST, "empty")
    assert_still_serves(srv.engine, MAIN, srv.hf)


ACCEPTED = [
    ("list", list),
    ("tuple", tuple),
    ("torch_L", lambda p: torch.tensor(p)),
    ("torch_1xL", lambda p: torch.tensor([p])),
    ("torch_int32", lambda p: torch.tensor(p, dtype=torch.int32)),
    ("numpy_int64", lambda p: np.array(p, dtype=np.int64)),
    ("numpy_1xL", lambda p: np.array([p], dtype=np.int64)),
]


@pytest.mark.parametrize("form,conv", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted_input_forms(srv, form, conv):
    prompt = random_prompt(9, seed=77)
    status, handle, queue = srv.engine.start_request(MAIN, {"input_ids": conv(prompt)}, GOOD)
    assert status == OK, srv.engine.get_last_error()
    tokens, _, final = collect(queue, HANG_S)
    assert srv.engine.release_request(MAIN, handle) == OK
    assert final == GenerateRequestStatus.GenerateFinished
    assert tokens == hf_ref(srv.hf, prompt, 8)


def test_start_request_text_not_a_string(srv):
    st, handle, queue = srv.engine.start_request_text(MAIN, srv.loader, 123, GOOD)
    assert (st, handle, queue) == (PARAM, None, None)
    assert "text must be a str" in srv.engine.get_last_error() and "int" in srv.engine.get_last_error()
    assert_still_serves(srv.engine, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# lengths and KV capacity
# ------------------------------------------------------------------------------------------------

def test_prompt_longer_than_engine_max_length(srv):
    for n in (ENGINE_MAX_LENGTH + 1, ENGINE_MAX_LENGTH):      # 1024 tokens also leaves no room
        start_fail(srv.engine, MAIN, {"input_ids": random_prompt(n, seed=n)}, {"max_new_tokens": 4},
                   EXCEED, f"prompt of {n} tokens", str(ENGINE_MAX_LENGTH))
        assert_still_serves(srv.engine, MAIN, srv.hf)
    # the longest prompt that still fits generates exactly one token, whatever max_new_tokens says
    tokens, _ = _gen(srv, random_prompt(ENGINE_MAX_LENGTH - 1, seed=3), {"top_k": 1, "max_new_tokens": 8,
                                                                         "eos_token_id": []})
    assert len(tokens) == 1
    assert_still_serves(srv.engine, MAIN, srv.hf)


def test_max_length_above_engine_max_length(srv):
    start_fail(srv.engine, MAIN, {"input_ids": PROBE_PROMPT}, {"max_length": ENGINE_MAX_LENGTH + 1}, EXCEED,
               f"max_length {ENGINE_MAX_LENGTH + 1}", "engine_max_length")
    assert_still_serves(srv.engine, MAIN, srv.hf)


@pytest.mark.parametrize("gen", [{"max_length": 10}, {"max_length": 5}, {"max_length": 10, "max_new_tokens": 5}])
def test_prompt_not_shorter_than_max_length(srv, gen):
    prompt = random_prompt(10, seed=10)
    start_fail(srv.engine, MAIN, {"input_ids": prompt}, gen, EXCEED, "prompt of 10 tokens",
               f"max_length {gen['max_length']}")
    assert_still_serves(srv.engine, MAIN, srv.hf)


def _gen(srv, prompt, gen, name=MAIN):
    status, handle, queue = srv.engine.start_request(name, {"input_ids": prompt}, gen)
    assert status == OK, srv.engine.get_last_error()
    tokens, elements, final = collect(queue, HANG_S)
    assert srv.engine.release_request(name, handle) == OK
    assert final == GenerateRequestStatus.GenerateFinished, (final, queue.ErrorMessage())
    return tokens, elements


def test_tighter_of_max_length_and_max_new_tokens_wins(srv):
    prompt = random_prompt(10, seed=11)
    tokens, _ = _gen(srv, prompt, {"top_k": 1, "eos_token_id": [], "max_length": 100, "max_new_tokens": 5})
    assert tokens == hf_ref(srv.hf, prompt, 5)
    tokens, _ = _gen(srv, prompt, {"top_k": 1, "eos_token_id": [], "max_length": 14, "max_new_tokens": 50})
    assert tokens == hf_ref(srv.hf, prompt, 4)
    assert_still_serves(srv.engine, MAIN, srv.hf)


def test_prompt_larger_than_whole_kv_cache(llama, tmp_path_factory):
    loader = serialize(llama.hf_dir, "errs_kv", str(tmp_path_factory.mktemp("errs_kv")))
    a = loader.args
    span = 16
    per_span = 2 * a.num_layers * span * a.num_kv_heads * a.head_dim * 4      # K and V, float32
    # a budget below one span is refused at install, with the reason
    with pytest.raises(AsException) as ei:
        start_engine(loader, "errs_kv", max_length=256, span_size=span, kv_bytes=per_span - 1)
    assert "smaller than one span" in str(ei.value)

    engine = start_engine(loader, "errs_kv", max_length=256, span_size=span, kv_bytes=4 * per_span + per_span // 2)
    try:
        stat = engine.get_as_engine_stat("errs_kv")
        assert (stat.total_span, stat.total_token) == (4, 4 * span)
        for n in (4 * span + 1, 100):   # prompts larger than the whole 64-token cache
            start_fail(engine, "errs_kv", {"input_ids": random_prompt(n, seed=n)}, GOOD,
                       AsStatus.ALLSPARK_CACHE_MEMORY_OUT, f"prompt of {n} tokens", "KV cache", str(4 * span))
            assert_still_serves(engine, "errs_kv", llama.model)
        # 63 prompt tokens + 1 generated fit
        prompt = random_prompt(4 * span - 1, seed=5)
        status, handle, queue = engine.start_request("errs_kv", {"input_ids": prompt}, {**GOOD, "max_new_tokens": 1})
        assert status == OK, engine.get_last_error()
        tokens, _, final = collect(queue, HANG_S)
        assert engine.release_request("errs_kv", handle) == OK
        assert final == GenerateRequestStatus.GenerateFinished and tokens == hf_ref(llama.model, prompt, 1)
        # a prompt that fits but whose output outgrows the whole cache is interrupted, with a reason
        prompt = random_prompt(60, seed=6)
        status, handle, queue = engine.start_request("errs_kv", {"input_ids": prompt}, {**GOOD, "max_new_tokens": 20})
        assert status == OK, engine.get_last_error()
        tokens, _, final = collect(queue, HANG_S)
        assert engine.release_request("errs_kv", handle) == OK
        assert final == GenerateRequestStatus.GenerateInterrupted
        assert "KV cache" in queue.ErrorMessage()
        assert 0 < len(tokens) < 20
        assert_same_tokens(tokens, hf_ref(llama.model, prompt, len(tokens)))
        assert_still_serves(engine, "errs_kv", llama.model)
    finally:
        engine.sync_request("errs_kv")
        assert engine.release_model("errs_kv") == OK



def test_the_prefill_budget_defaults_per_device():
    """max_prefill_length 0 means 1024 tokens a step on CPUs and 4096 on GPUs; a set value is kept on both."""
    from allspark_client.config import AsModelConfig
    base = dict(model_name="m", model_path="m.asgraph", weights_path="m.asparam")
    assert AsModelConfig(compute_unit="CPU:0", **base).max_prefill_tokens == 1024
    assert AsModelConfig(compute_unit="CUDA:0", **base).max_prefill_tokens == 4096
    for unit in ("CPU:0", "CUDA:0,1"):
        assert AsModelConfig(compute_unit=unit, engine_max_prefill_length=300, **base).max_prefill_tokens == 300
