"""Error paths of the in-process Engine, lifecycle side: request handles, models (install, lifecycle),
the runtime config builder and the HF loader, stopping / syncing live requests, and concurrency. After
each error the engine must still serve (see errors_helpers.assert_still_serves)."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch

from allspark_client import AsException, AsStatus, GenerateRequestStatus, RequestHandle
from allspark_server import AsModelRuntimeConfigBuilder, HuggingFaceModel, ModelSerializerException, TargetDevice
from allspark_client.config import ConfigError
from errors_helpers import (ENGINE_MAX_LENGTH, EXCEED, GOOD, HANG_S, ILLEGAL, MAIN, OK, OTHER, PARAM, PROBE_PROMPT,
                            assert_still_serves, start_fail)
from helpers import greedy, hf_ref, random_prompt


def wait_terminal(queue):
    assert queue._wait_terminal(HANG_S), "request did not finish (hang?)"


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
    ("cache_mode_name", dict(kv_cache_mode="int4"), "cache_mode"),
    ("cache_mode_bool", dict(kv_cache_mode=True), "cache_mode"),
    ("cache_mode_list", dict(kv_cache_mode=["int8"]), "cache_mode"),
    ("prefix_cache_str", dict(prefill_cache="yes"), "enable_prefix_cache"),
    ("prefix_cache_ttl_0", dict(prefix_cache_ttl=0), "prefix_cache_ttl"),
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
    import allspark_server.engine.engine as engine_mod
    e, name = srv.engine, "errs_race"
    assert e.install_model(_cfg(srv, name).build()) == OK and e.start_model(name) == OK
    real_parse = engine_mod.parse_request
    stopped = []

    def parse_then_stop(*args, **kw):       # runs between the is_running check and the registration
        if not stopped:
            stopped.append(e.stop_model(name))
        return real_parse(*args, **kw)

    monkeypatch.setattr(engine_mod, "parse_request", parse_then_stop)
    status, handle, queue = e.start_request(name, {"input_ids": PROBE_PROMPT}, GOOD)
    monkeypatch.setattr(engine_mod, "parse_request", real_parse)
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
