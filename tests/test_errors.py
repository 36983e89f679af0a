"""Error paths of the in-process Engine (and the config / loader errors that feed it).

Every rejected call is checked for its AsStatus (or exception type) and for a message naming what
was wrong; after each error the engine must still serve a normal greedy request that matches the
HuggingFace model token for token, hold no KV spans and no leaked requests.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from allspark_client import AsCacheMode, AsException, AsStatus, GenerateRequestStatus, RequestHandle
from allspark_server import (AsModelRuntimeConfigBuilder, ASGenerationConfigBuilder, Engine, HuggingFaceModel,
                             ModelSerializerException, TargetDevice)
from allspark_client.config import ConfigError
from helpers import collect, greedy, hf_greedy, random_prompt, serialize, start_engine

MAIN = "errs_main"          # the model every test checks the engine still serves
OTHER = "errs_other"        # a second model on the same engine (for cross-model handles)
ENGINE_MAX_LENGTH = 1024
GOOD = {"top_k": 1, "max_new_tokens": 8, "eos_token_id": []}
PROBE_PROMPT = random_prompt(7, seed=4242)
HANG_S = 120.0               # generous: only to turn a hang into a failure

OK = AsStatus.ALLSPARK_SUCCESS
PARAM = AsStatus.ALLSPARK_PARAM_ERROR
ILLEGAL = AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID
EXCEED = AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR

_hf_cache: dict = {}


def hf_ref(hf_model, ids, n: int) -> list[int]:
    key = (id(hf_model), tuple(ids), n)
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(hf_model, ids, n)
    return _hf_cache[key]


def assert_still_serves(engine: Engine, name: str, hf_model, restart: bool = True) -> None:
    """A normal greedy request still matches HF; nothing leaked (spans, queued/running requests and,
    with `restart`, unreleased handles: stop_model refuses while any is unreleased); restart works."""
    assert greedy(engine, name, PROBE_PROMPT, 8) == hf_ref(hf_model, PROBE_PROMPT, 8)
    stat = engine.get_as_engine_stat(name)
    assert (stat.used_span, stat.running_request, stat.pendding_request) == (0, 0, 0), stat
    if not restart:
        return
    assert engine.stop_model(name) == OK, engine.get_last_error()
    assert engine.start_model(name) == OK, engine.get_last_error()


def start_fail(engine: Engine, name: str, inputs, gen, status: AsStatus, *mentions: str) -> str:
    st, handle, queue = engine.start_request(name, inputs, gen)
    assert st == status, (st, engine.get_last_error())
    assert handle is None and queue is None
    msg = engine.get_last_error()
    for m in mentions:
        assert m in msg, (m, msg)
    return msg


def wait_terminal(queue):
    assert queue._wait_terminal(HANG_S), "request did not finish (hang?)"


@pytest.fixture(scope="module")
def srv(llama, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("errs_as"))
    loader = serialize(llama.hf_dir, MAIN, out)
    engine = start_engine(loader, MAIN, max_batch=8, max_length=ENGINE_MAX_LENGTH)
    start_engine(loader, OTHER, engine=engine, max_batch=2, max_length=64)
    s = SimpleNamespace(engine=engine, loader=loader, hf=llama.model, vocab=loader.args.vocab_size,
                        tmp=tmp_path_factory)
    yield s
    for name in (MAIN, OTHER):
        engine.sync_request(name)
        engine.release_model(name)


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
    ({"response_format": {"type": "json_object"}}, "response_format"),
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
        assert tokens == hf_ref(llama.model, prompt, len(tokens))
        assert_still_serves(engine, "errs_kv", llama.model)
    finally:
        engine.sync_request("errs_kv")
        assert engine.release_model("errs_kv") == OK


# ------------------------------------------------------------------------------------------------
# request handles
# ------------------------------------------------------------------------------------------------

def _all_handle_calls(engine, name, handle):
    return {"stop": engine.stop_request(name, handle), "release": engine.release_request(name, handle),
            "sync": engine.sync_request(name, handle)}


def test_unknown_handle(srv):
    e = srv.engine
    for handle in (RequestHandle(MAIN, 999999), None, 999999, "abc"):
        for call in (e.stop_request, e.release_request, e.sync_request):
            if handle is None and call == e.sync_request:
                continue        # sync_request(name, None) means "all requests"
            assert call(MAIN, handle) == ILLEGAL, (call.__name__, handle)
            assert repr(handle) in e.get_last_error() and MAIN in e.get_last_error()
    assert_still_serves(e, MAIN, srv.hf)


def test_handle_of_another_model(srv):
    e = srv.engine
    st_a, h_a, q_a = e.start_request(MAIN, {"input_ids": PROBE_PROMPT}, GOOD)
    st_b, h_b, q_b = e.start_request(OTHER, {"input_ids": PROBE_PROMPT}, GOOD)
    assert st_a == OK and st_b == OK
    try:
        wait_terminal(q_a)
        wait_terminal(q_b)
        for name, handle in ((MAIN, h_b), (OTHER, h_a),
                             (MAIN, RequestHandle(OTHER, h_a.request_id)),   # right id, wrong model name
                             (OTHER, RequestHandle(MAIN, h_b.request_id))):
            assert _all_handle_calls(e, name, handle) == {"stop": ILLEGAL, "release": ILLEGAL, "sync": ILLEGAL}
            assert "unknown or released request handle" in e.get_last_error()
        # the wrong-model calls did not touch the real requests
        for q in (q_a, q_b):
            assert q.GenerateStatus() == GenerateRequestStatus.GenerateFinished
            assert q.GeneratedLength() == 8
            assert q.GetNoWait().ids_from_generate == hf_ref(srv.hf, PROBE_PROMPT, 8)
    finally:
        assert e.release_request(MAIN, h_a) == OK
        assert e.release_request(OTHER, h_b) == OK
    assert_still_serves(e, MAIN, srv.hf)
    assert_still_serves(e, OTHER, srv.hf)


def test_released_handle_and_its_queue(srv):
    e = srv.engine
    prompt = random_prompt(12, seed=21)
    status, handle, queue = e.start_request(MAIN, {"input_ids": prompt}, GOOD)
    assert status == OK
    assert e.sync_request(MAIN, handle) == OK
    assert e.release_request(MAIN, handle) == OK
    # double release, and every other call with the released handle
    assert _all_handle_calls(e, MAIN, handle) == {"stop": ILLEGAL, "release": ILLEGAL, "sync": ILLEGAL}
    assert repr(handle) in e.get_last_error()
    # the queue still hands out everything it had
    assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
    assert queue.GeneratedLength() == 8
    el = queue.Get()
    assert el.ids_from_generate == hf_ref(srv.hf, prompt, 8)
    assert queue.Get() is None and queue.GetNoWait() is None
    assert_still_serves(e, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------

def test_unknown_model(srv):
    e = srv.engine
    start_fail(e, "nope", {"input_ids": PROBE_PROMPT}, GOOD, PARAM, "'nope'", "not installed")
    for call in (e.start_model, e.stop_model, e.release_model, e.sync_request):
        assert call("nope") == PARAM, call.__name__
        assert "'nope'" in e.get_last_error() and "not installed" in e.get_last_error()
    for call in (e.stop_request, e.release_request, e.sync_request):
        assert call("nope", RequestHandle("nope", 1)) == PARAM, call.__name__
        assert "'nope'" in e.get_last_error()
    for call in (e.get_model_info, e.get_as_engine_stat):
        with pytest.raises(AsException) as ei:
            call("nope")
        assert ei.value.status == PARAM and "'nope'" in str(ei.value), call.__name__
    assert_still_serves(e, MAIN, srv.hf)


def _cfg(srv, name, max_length=64, **kw):
    b = srv.loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=2)
    b.max_length(max_length).kv_cache_span_size(16)
    for k, v in kw.items():
        getattr(b, k)(v)
    return b


def test_install_errors(srv):
    e = srv.engine
    with pytest.raises(AsException) as ei:
        e.install_model(_cfg(srv, MAIN).build())
    assert ei.value.status == PARAM and "already installed" in str(ei.value) and MAIN in str(ei.value)
    for not_cfg in ({"model_name": "x"}, _cfg(srv, "errs_builder"), None):
        with pytest.raises(AsException) as ei:
            e.install_model(not_cfg)
        assert "AsModelConfig" in str(ei.value) and type(not_cfg).__name__ in str(ei.value)
    assert_still_serves(e, MAIN, srv.hf)


def test_install_missing_files(srv):
    e = srv.engine
    d = str(srv.tmp.mktemp("errs_missing"))
    b = AsModelRuntimeConfigBuilder().model_name("errs_missing").model_dir(d, "absent").max_length(64)
    with pytest.raises(AsException) as ei:
        e.install_model(b.build())
    assert "does not exist" in str(ei.value) and os.path.join(d, "absent.asgraph") in str(ei.value)
    # weights missing, graph present
    shutil.copy(srv.loader.graph_path, os.path.join(d, "half.asgraph"))
    b = AsModelRuntimeConfigBuilder().model_name("errs_missing").model_dir(d, "half").max_length(64)
    with pytest.raises(AsException) as ei:
        e.install_model(b.build())
    assert "does not exist" in str(ei.value) and os.path.join(d, "half.asparam") in str(ei.value)
    # the failed name was not registered: installing it for real works
    with pytest.raises(AsException):
        e.get_model_info("errs_missing")
    assert e.install_model(_cfg(srv, "errs_missing").build()) == OK
    assert e.start_model("errs_missing") == OK
    assert_still_serves(e, "errs_missing", srv.hf)
    assert e.release_model("errs_missing") == OK
    assert_still_serves(e, MAIN, srv.hf)


def test_install_garbage_asgraph(srv):
    e = srv.engine
    d = str(srv.tmp.mktemp("errs_garbage"))
    with open(os.path.join(d, "g.asgraph"), "wb") as f:
        f.write(b"\xff\x13this is not a protobuf" * 10)
    shutil.copy(srv.loader.weights_path, os.path.join(d, "g.asparam"))
    b = AsModelRuntimeConfigBuilder().model_name("errs_garbage").model_dir(d, "g").max_length(64)
    with pytest.raises(AsException) as ei:
        e.install_model(b.build())
    assert "is not an allspark .asgraph file" in str(ei.value) and "g.asgraph" in str(ei.value)
    with pytest.raises(AsException):
        e.get_model_info("errs_garbage")
    assert_still_serves(e, MAIN, srv.hf)


def test_install_garbage_asparam(srv):
    e = srv.engine
    d = str(srv.tmp.mktemp("errs_garbage_param"))
    shutil.copy(srv.loader.graph_path, os.path.join(d, "p.asgraph"))
    with open(os.path.join(d, "p.asparam"), "wb") as f:
        f.write(b"garbage" * 10)
    b = AsModelRuntimeConfigBuilder().model_name("errs_garbage_param").model_dir(d, "p").max_length(64)
    try:
        with pytest.raises(AsException) as ei:
            e.install_model(b.build())
        assert "p.asparam" in str(ei.value)
    finally:
        assert_still_serves(e, MAIN, srv.hf)


def test_model_lifecycle_errors(srv):
    e, name = srv.engine, "errs_life"
    assert e.install_model(_cfg(srv, name).build()) == OK
    try:
        # installed, never started
        start_fail(e, name, {"input_ids": PROBE_PROMPT}, GOOD, AsStatus.ALLSPARK_REQUEST_DENIED, name, "not started")
        assert json.loads(e.get_model_info(name))["started"] is False
        assert e.start_model(name) == OK and e.start_model(name) == OK     # starting twice is harmless
        assert json.loads(e.get_model_info(name))["started"] is True
        # an unreleased (finished) request blocks stop_model / release_model
        status, handle, queue = e.start_request(name, {"input_ids": PROBE_PROMPT}, GOOD)
        assert status == OK
        wait_terminal(queue)
        for call in (e.stop_model, e.release_model):
            assert call(name) == AsStatus.ALLSPARK_RUNTIME_ERROR
            msg = e.get_last_error()
            assert "release_request" in msg and "1 unreleased" in msg and name in msg
        assert greedy(e, name, PROBE_PROMPT, 8) == hf_ref(srv.hf, PROBE_PROMPT, 8)   # refused stop kept it up
        assert_still_serves(e, MAIN, srv.hf)
        assert e.release_request(name, handle) == OK
        assert e.stop_model(name) == OK
        # stopped: requests are denied, the model stays installed
        start_fail(e, name, {"input_ids": PROBE_PROMPT}, GOOD, AsStatus.ALLSPARK_REQUEST_DENIED, name)
        assert json.loads(e.get_model_info(name))["started"] is False
        assert e.stop_model(name) == OK                                       # stopping twice is harmless
        assert_still_serves(e, MAIN, srv.hf)
        # restarted: serves again
        assert e.start_model(name) == OK
        assert greedy(e, name, PROBE_PROMPT, 8) == hf_ref(srv.hf, PROBE_PROMPT, 8)
        # released: gone
        assert e.release_model(name) == OK
        start_fail(e, name, {"input_ids": PROBE_PROMPT}, GOOD, PARAM, name, "not installed")
        assert e.release_model(name) == PARAM and e.start_model(name) == PARAM
        with pytest.raises(AsException):
            e.get_model_info(name)
        assert_still_serves(e, MAIN, srv.hf)
        # the name can be installed again
        assert e.install_model(_cfg(srv, name).build()) == OK
        assert e.start_model(name) == OK
        assert_still_serves(e, name, srv.hf)
    finally:
        e.sync_request(name)
        e.release_model(name)
    assert_still_serves(e, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# runtime config builder and loader
# ------------------------------------------------------------------------------------------------

BAD_RUNTIME = [
    ("span_20", dict(kv_cache_span_size=20), "cache_span_size"),
    ("max_length_2", dict(max_length=2), "engine_max_length"),
    ("max_batch_0", dict(max_batch=0), "engine_max_batch"),
    ("max_batch_bool", dict(max_batch=True), "engine_max_batch"),
    ("cache_int8", dict(kv_cache_mode=AsCacheMode.AsCacheQuantI8), "cache_mode"),
    ("prefix_cache", dict(prefill_cache=True), "enable_prefix_cache"),
    ("precision", dict(matmul_precision="low"), "matmul_precision"),
    ("unknown_dict_key", dict(update_from_dict={"bogus_runtime_key": 1}), "bogus_runtime_key"),
]


@pytest.mark.parametrize("case,kw,mention", BAD_RUNTIME, ids=[c[0] for c in BAD_RUNTIME])
def test_runtime_config_errors(srv, case, kw, mention):
    with pytest.raises(ConfigError) as ei:
        _cfg(srv, "errs_cfg", **kw).build()
    assert ei.value.status == PARAM and mention in str(ei.value)
    assert_still_serves(srv.engine, MAIN, srv.hf)


def test_runtime_config_missing_model_path(srv):
    with pytest.raises(ConfigError) as ei:
        AsModelRuntimeConfigBuilder().model_name("errs_cfg").max_length(64).build()
    assert "missing model_path" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        AsModelRuntimeConfigBuilder().model_file_path("a.asgraph", "a.asparam").build()
    assert "missing model_name" in str(ei.value)
    assert_still_serves(srv.engine, MAIN, srv.hf)


def test_runtime_config_unknown_cache_mode(srv):
    with pytest.raises(ConfigError) as ei:
        _cfg(srv, "errs_cfg", kv_cache_mode=7).build()
    assert "cache_mode" in str(ei.value)


def test_hf_loader_errors(llama, tmp_path):
    with pytest.raises(ModelSerializerException, match="not a local folder"):
        HuggingFaceModel(str(tmp_path / "does_not_exist"), "x")

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                  "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4}))
    with pytest.raises(ModelSerializerException) as ei:
        HuggingFaceModel(str(gpt2), "x")
    msg = str(ei.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg

    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(llama.hf_dir, "model.safetensors"))
    for case, edit, mention in (
            ("missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), "model.layers.1.mlp.down_proj.weight"),
            ("shape", lambda t: t.__setitem__("model.norm.weight", torch.ones(3)), "model.norm.weight")):
        d = tmp_path / case
        shutil.copytree(llama.hf_dir, d)
        t = dict(tensors)
        edit(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        loader = HuggingFaceModel(str(d), "x", user_set_data_type="float32")
        with pytest.raises(ModelSerializerException) as ei:
            loader.load_model()
        assert mention in str(ei.value), case


# ------------------------------------------------------------------------------------------------
# stopping and syncing live requests
# ------------------------------------------------------------------------------------------------

LONG = {"top_k": 1, "max_new_tokens": 500, "eos_token_id": []}


@pytest.mark.parametrize("how", ["stop_request", "release_request"])
def test_stop_mid_stream(srv, how):
    e = srv.engine
    prompt = random_prompt(8, seed=31)
    status, handle, queue = e.start_request(MAIN, {"input_ids": prompt}, LONG)
    assert status == OK
    try:
        first = queue.GetWithTimeout(int(HANG_S * 1000))
        assert first is not None and len(first.ids_from_generate) >= 1
        assert getattr(e, how)(MAIN, handle) == OK
        # stop/release return once the engine has taken the request out: the status is final now
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
        tokens = list(first.ids_from_generate)
        while (el := queue.GetNoWait()) is not None:
            tokens.extend(el.ids_from_generate)
        n = queue.GeneratedLength()
        assert len(tokens) == n and n <= 500
        assert queue.Get() is None                       # terminal and drained: no blocking
        k = min(n, 8)
        assert tokens[:k] == hf_ref(srv.hf, prompt, 8)[:k]
        assert_still_serves(e, MAIN, srv.hf, restart=False)   # others run; the stopped one stays still
        assert queue.GeneratedLength() == n and queue.GetNoWait() is None
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
    finally:
        if how == "stop_request":
            assert e.stop_request(MAIN, handle) == OK     # stopping a stopped (unreleased) request is fine
            assert e.release_request(MAIN, handle) == OK
    assert e.stop_request(MAIN, handle) == ILLEGAL
    assert_still_serves(e, MAIN, srv.hf)


def test_sync_all_requests(srv):
    e = srv.engine
    prompts = [random_prompt(5 + i, seed=40 + i) for i in range(3)]
    lengths = [16, 24, 32]
    started = [e.start_request(MAIN, {"input_ids": p}, {**GOOD, "max_new_tokens": n})
               for p, n in zip(prompts, lengths)]
    assert all(s == OK for s, _, _ in started)
    done = []
    t = threading.Thread(target=lambda: done.append(e.sync_request(MAIN, None)), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive() and done == [OK]
    for (_, handle, queue), p, n in zip(started, prompts, lengths):
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
        assert queue.GeneratedLength() == n
        assert e.release_request(MAIN, handle) == OK
    assert e.sync_request(MAIN, None) == OK          # nothing live: returns at once
    assert_still_serves(e, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------

def test_concurrent_bad_and_good_requests(srv):
    e, n_threads, rounds = srv.engine, 8, 2
    prompts = [random_prompt(4 + i, seed=60 + i) for i in range(n_threads)]
    expected = [hf_ref(srv.hf, p, 8) for p in prompts]       # HF is not thread safe: compute up front
    # this thread's last error must survive the other threads' errors (get_last_error is per thread)
    start_fail(e, MAIN, {"input_ids": PROBE_PROMPT}, {"main_thread_marker": 1}, PARAM, "main_thread_marker")
    barrier = threading.Barrier(n_threads)
    errors: list = []
    results: dict = {}

    def worker(i: int):
        try:
            barrier.wait(HANG_S)
            got = []
            for r in range(rounds):
                start_fail(e, MAIN, {"input_ids": prompts[i]}, {f"bogus_{i}_{r}": 1}, PARAM, f"bogus_{i}_{r}")
                start_fail(e, MAIN, {"input_ids": [5, srv.vocab + i]}, GOOD, PARAM, str(srv.vocab + i))
                start_fail(e, MAIN, {"input_ids": prompts[i]}, {"max_length": ENGINE_MAX_LENGTH + 1 + i}, EXCEED,
                           str(ENGINE_MAX_LENGTH + 1 + i))
                assert e.release_request(MAIN, RequestHandle(MAIN, 10**9 + i)) == ILLEGAL
                assert str(10**9 + i) in e.get_last_error()
                got.append(greedy(e, MAIN, prompts[i], 8))
            results[i] = got
        except BaseException as ex:   # reported below
            errors.append((i, repr(ex)))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert errors == []
    assert results == {i: [expected[i]] * rounds for i in range(n_threads)}
    assert "main_thread_marker" in e.get_last_error()
    assert_still_serves(e, MAIN, srv.hf)


def test_stop_model_racing_start_request(srv, monkeypatch):
    """Deterministic replay of the race: stop_model runs after start_request's is_running check."""
    import allspark_server.engine as engine_mod
    e, name = srv.engine, "errs_race"
    assert e.install_model(_cfg(srv, name).build()) == OK and e.start_model(name) == OK
    real_parse = engine_mod.parse_generation_config
    stopped = []

    def parse_then_stop(*args, **kw):       # runs between the is_running check and the registration
        if not stopped:
            stopped.append(e.stop_model(name))
        return real_parse(*args, **kw)

    monkeypatch.setattr(engine_mod, "parse_generation_config", parse_then_stop)
    status, handle, queue = e.start_request(name, {"input_ids": PROBE_PROMPT}, GOOD)
    monkeypatch.setattr(engine_mod, "parse_generation_config", real_parse)
    try:
        assert stopped == [OK]
        assert status == AsStatus.ALLSPARK_REQUEST_DENIED, "accepted a request into a model being stopped"
    finally:
        if status == OK:      # the request sits in the stopped loop's inbox until the model restarts
            assert queue.GenerateStatus() == GenerateRequestStatus.Init
            assert e.start_model(name) == OK
            wait_terminal(queue)
            assert e.release_request(name, handle) == OK
        assert e.release_model(name) == OK
        assert_still_serves(e, MAIN, srv.hf)


def test_start_request_text_not_a_string(srv):
    st, handle, queue = srv.engine.start_request_text(MAIN, srv.loader, 123, GOOD)
    assert (st, handle, queue) == (PARAM, None, None)
    assert "text must be a str" in srv.engine.get_last_error() and "int" in srv.engine.get_last_error()
    assert_still_serves(srv.engine, MAIN, srv.hf)
