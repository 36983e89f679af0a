"""Error paths of the in-process Engine, model side: unknown models, installing one (bad configs, missing and
garbage files), a model's lifecycle (start / stop / release), the runtime config builder and the HF loader. After
each error the engine must still serve (see errors_helpers.assert_still_serves)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from errors_helpers import (
    GOOD,
    MAIN,
    OK,
    PARAM,
    PROBE_PROMPT,
    assert_still_serves,
    runtime_builder,
    start_fail,
    wait_terminal,
)
from helpers import greedy, hf_ref

from allspark_client import AsException, AsStatus, RequestHandle
from allspark_client.config import ConfigError
from allspark_server import AsModelRuntimeConfigBuilder, HuggingFaceModel, ModelSerializerException

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


def test_install_errors(srv):
    e = srv.engine
    with pytest.raises(AsException) as ei:
        e.install_model(runtime_builder(srv, MAIN).build())
    assert ei.value.status == PARAM and "already installed" in str(ei.value) and MAIN in str(ei.value)
    for not_cfg in ({"model_name": "x"}, runtime_builder(srv, "errs_builder"), None):
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
    assert e.install_model(runtime_builder(srv, "errs_missing").build()) == OK
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
    assert e.install_model(runtime_builder(srv, name).build()) == OK
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
        assert e.install_model(runtime_builder(srv, name).build()) == OK
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
        runtime_builder(srv, "errs_cfg", **kw).build()
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
        runtime_builder(srv, "errs_cfg", kv_cache_mode=7).build()
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
