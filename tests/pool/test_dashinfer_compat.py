"""DashInfer calls ported code still makes (issue 38 §1-2): the deprecated ResultQueue shortcuts, get_free_frame,
get_file_information, the config builders from a torch-free allspark_client, and the refusal of model files of
another format version; on the in-process Engine and a 2-rank pool's ClientEngine alike (the `api` fixture)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from contract_helpers import GREEDY, HANG_S, NAME, OK, PROBE, S, run

from allspark_client import AsException, AsFileInfo, __version__
from allspark_client._proto import allspark_pb2 as pb


def test_deprecated_calls_warn_and_give_what_the_queue_gives(api):
    engine, _, _ = api
    gen = {**GREEDY, "max_new_tokens": 12}
    expected, _, _ = run(engine, PROBE, gen)        # read through the ResultQueue itself
    status, handle, queue = engine.start_request(NAME, {"input_ids": PROBE}, gen)
    assert status == OK, engine.get_last_error()
    try:
        got = []
        while True:
            with pytest.warns(DeprecationWarning, match=r"ResultQueue\.Get\(\)"):
                ids = engine.get_wait(NAME, queue)
            if ids is None:
                break
            assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
            got += ids
        assert got == expected and len(got) == 12
        with pytest.warns(DeprecationWarning, match=r"ResultQueue\.GenerateStatus\(\)"):
            status_now = engine.get_request_status(NAME, queue)
        assert status_now == queue.GenerateStatus() == S.GenerateFinished
        with pytest.warns(DeprecationWarning, match=r"ResultQueue\.GetNoWait\(\)"):
            assert engine.get_no_wait(NAME, queue) is None      # drained: GetNoWait gives None too
        assert queue.GetNoWait() is None
        with pytest.warns(DeprecationWarning), pytest.raises(AsException, match="ResultQueue"):
            engine.get_no_wait(NAME, handle)
    finally:
        assert engine.release_request(NAME, handle) == OK


def test_deprecated_get_no_wait_returns_the_new_ids(api):
    engine, _, _ = api
    gen = {**GREEDY, "max_new_tokens": 8}
    expected, _, _ = run(engine, PROBE, gen)
    status, handle, queue = engine.start_request(NAME, {"input_ids": PROBE}, gen)
    assert status == OK
    try:
        assert engine.sync_request(NAME, handle) == OK
        with pytest.warns(DeprecationWarning):
            assert engine.get_no_wait(NAME, queue) == expected      # everything generated, in one piece
    finally:
        assert engine.release_request(NAME, handle) == OK


def test_free_frame_counts_one_layer_k_or_v_span_as_a_frame(api):
    """A DashInfer frame is span_size tokens of one layer's K or V; ours hold every layer's K and V per span.
    The frame size is checked against the HF config through the KV bytes the model reports."""
    engine, _, hf = api
    cfg = hf.config
    info = json.loads(engine.get_model_info(NAME))
    stat = engine.get_as_engine_stat(NAME)
    assert stat.used_span == 0 and stat.free_span > 0
    frames = engine.get_free_frame(NAME)
    assert frames == stat.free_span * 2 * cfg.num_hidden_layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads // info["world_size"]       # heads are split over the ranks
    frame_bytes = info["span_size"] * kv_heads * head_dim * 4       # fp32 cache
    assert info["kv_cache_bytes"] == info["kv_spans"] * 2 * cfg.num_hidden_layers * frame_bytes
    with pytest.raises(AsException, match="nosuch"):
        engine.get_free_frame("nosuch")


def test_file_information_reads_both_headers(api):
    from safetensors import safe_open
    engine, loader, _ = api
    info = engine.get_file_information(loader.graph_path, loader.weights_path)
    g = pb.ModelGraph()
    with open(loader.graph_path, "rb") as f:
        g.ParseFromString(f.read())
    with safe_open(loader.weights_path, "np") as f:
        meta = f.metadata()
    assert isinstance(info, AsFileInfo)
    assert info == (g.build_meta.allspark_version, meta["allspark_version"], __version__)
    assert info.create_version_graph == info.create_version_param == __version__
    with pytest.raises(AsException, match="does not exist"):
        engine.get_file_information(loader.graph_path + ".missing", loader.weights_path)
    with pytest.raises(AsException, match="not an allspark .asparam"):
        engine.get_file_information(loader.graph_path, loader.graph_path)


def test_install_refuses_another_format_version_naming_both(api, tmp_path):
    engine, loader, _ = api
    g = pb.ModelGraph()
    with open(loader.graph_path, "rb") as f:
        g.ParseFromString(f.read())
    g.format_version += 1
    graph = tmp_path / "future.asgraph"
    graph.write_bytes(g.SerializeToString())
    cfg = (loader.create_reference_runtime_config_builder("future", "cpu", [0], max_batch=2)
           .model_file_path(str(graph), loader.weights_path).build())
    with pytest.raises(AsException) as e:
        engine.install_model(cfg)
    msg = str(e.value)
    assert f"format version {g.format_version}" in msg and f"reads format version {g.format_version - 1}" in msg, msg
    with pytest.raises(AsException):        # nothing was installed under that name
        engine.get_model_info("future")


def test_config_builders_import_from_a_torch_free_client():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from allspark_client import (AsModelRuntimeConfigBuilder, ASGenerationConfigBuilder, AsModelConfig,\n"
            "                             AsFileInfo)\n"
            "import allspark_client\n"
            "assert {'AsModelRuntimeConfigBuilder', 'ASGenerationConfigBuilder', 'AsModelConfig'} "
            "<= set(allspark_client.__all__)\n"
            "cfg = (AsModelRuntimeConfigBuilder().model_name('m').model_file_path('m.asgraph', 'm.asparam')\n"
            "       .compute_unit('cpu', [0]).max_length(64).max_batch(2).build())\n"
            "assert isinstance(cfg, AsModelConfig) and cfg.model_name == 'm'\n"
            "ASGenerationConfigBuilder().build()\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _compat_script():
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "dashinfer_compat.py")
    spec = importlib.util.spec_from_file_location("dashinfer_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compat_script_calls_every_method_clean_on_engine_and_pool(llama, pool, tmp_path):
    """examples/dashinfer_compat.py on an in-process Engine and on the shared 2-rank pool's ClientEngine: every
    DashInfer method is there and gives what it should (greedy output equal to transformers', before and after
    unload_device_mem / load_device_mem, from save_model's files, and with a LoRA adapter equal to transformers +
    PEFT's)."""
    from allspark_server import Engine
    script = _compat_script()
    client, _ = pool
    ref = script.Reference(llama.hf_dir, 8, llama.model)
    engine = Engine()
    try:
        results = script.run_all({"Engine": engine, "ClientEngine": client}, ref, str(tmp_path),
                                 {"Engine": 1, "ClientEngine": 2})
    finally:
        engine.close()
    assert set(results["Engine"]) >= set(script.METHODS)
    assert script.all_ok(results), "\n" + script.table(results)
