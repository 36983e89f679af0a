"""Sleep/wake and DashInfer compat calls at their edges (issue 47 §3), on an Engine and a 2-rank pool's ClientEngine:
a wake that would read a weights file changed on disk since the install is refused (ALLSPARK_IO_ERROR, naming the
file) and the model stays asleep, able to wake once the file is back; get_free_frame is 0 while the model sleeps
(its KV cache is freed); get_file_information refuses None, non-object headers and a shut-down engine clearly."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import greedy, installed_on_pool, random_prompt, serialize, start_engine
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from allspark_client import AsException, AsStatus, ClientEngine
from allspark_server import Engine

PROMPT = random_prompt(20, seed=47)


def rewrite_weights(path: str) -> None:
    """The .asparam at `path` with every float tensor halved: the same names, shapes and metadata, other values."""
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = {k: v * 0.5 if v.is_floating_point() else v for k, v in load_file(path).items()}
    save_file(tensors, path + ".new", metadata=meta)
    os.replace(path + ".new", path)


def wake_refused(engine, name: str, weights: str) -> str:
    with pytest.raises(AsException) as e:
        engine.load_device_mem(name)
    assert e.value.status == AsStatus.ALLSPARK_IO_ERROR, e.value
    assert weights in e.value.message and "stays asleep" in e.value.message
    assert engine.get_as_engine_stat(name).asleep and json.loads(engine.get_model_info(name))["asleep"]
    status, _, _ = engine.start_request(name, {"input_ids": PROMPT}, {"top_k": 1, "max_new_tokens": 2})
    assert status == AsStatus.ALLSPARK_REQUEST_DENIED
    return e.value.message


def check_changed_weights_keep_it_asleep(engine, name: str, weights: str) -> None:
    """Asleep, the weights file is rewritten (then removed): wake is refused each time; with the installed file back
    the model wakes and generates what it did before. get_free_frame is 0 while asleep."""
    want = greedy(engine, name, PROMPT, 8)
    frames = engine.get_free_frame(name)
    assert frames > 0
    shutil.copyfile(weights, weights + ".installed")
    engine.unload_device_mem(name)
    assert engine.get_free_frame(name) == 0
    stat = engine.get_as_engine_stat(name)                 # the stats say the same: nothing free while asleep
    assert stat.asleep and stat.free_span == stat.free_token == 0 and stat.total_span > 0
    rewrite_weights(weights)
    assert "md5" in wake_refused(engine, name, weights)
    os.remove(weights)
    assert "gone" in wake_refused(engine, name, weights)
    os.replace(weights + ".installed", weights)
    assert engine.load_device_mem(name) is None
    assert engine.get_free_frame(name) == frames
    assert greedy(engine, name, PROMPT, 8) == want


def test_engine_wake_refuses_weights_changed_on_disk(llama, tmp_path):
    loader = serialize(llama.hf_dir, "edges", str(tmp_path))
    engine = start_engine(loader, "edges", max_batch=2, max_length=128)
    try:
        check_changed_weights_keep_it_asleep(engine, "edges", loader.weights_path)
    finally:
        engine.shutdown()


def test_pool_wake_refuses_weights_changed_on_disk(pool, llama, tmp_path):
    """Through ClientEngine: every rank reads the file, every rank names it; the pool serves on."""
    client, _ = pool
    loader = serialize(llama.hf_dir, "edges_pool", str(tmp_path))
    with installed_on_pool(client, loader, "edges_pool", max_length=128, max_batch=2):
        check_changed_weights_keep_it_asleep(client, "edges_pool", loader.weights_path)


def bad_params(tmp_path) -> dict[str, str]:
    """.asparam files whose safetensors header is JSON but not what the format says."""
    out = {}
    for name, header in (("list", b"[]"), ("meta_str", b'{"__metadata__": "x"}'), ("number", b"7")):
        path = tmp_path / f"{name}.asparam"
        path.write_bytes(len(header).to_bytes(8, "little") + header)
        out[name] = str(path)
    return out


def check_file_information_edges(engine, loader, tmp_path) -> None:
    for graph, param, words in ((None, loader.weights_path, "graph_path must be a path, got NoneType"),
                                (loader.graph_path, None, "param_path must be a path, got NoneType"),
                                (loader.graph_path, 3, "param_path must be a path, got int")):
        with pytest.raises(AsException) as e:
            engine.get_file_information(graph, param)
        assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR and words in e.value.message
    for name, path in bad_params(tmp_path).items():
        with pytest.raises(AsException) as e:
            engine.get_file_information(loader.graph_path, path)
        assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR, name
        assert path in e.value.message and "not an object" in e.value.message, e.value.message
    assert engine.get_file_information(loader.graph_path, loader.weights_path).create_version_param


def test_engine_file_information_edges_and_after_shutdown(llama, tmp_path):
    loader = serialize(llama.hf_dir, "info", str(tmp_path / "as"))
    engine = Engine()
    check_file_information_edges(engine, loader, tmp_path)
    engine.shutdown()
    with pytest.raises(AsException) as e:
        engine.get_file_information(loader.graph_path, loader.weights_path)
    assert e.value.status == AsStatus.ALLSPARK_INVALID_CALL_ERROR and "shut down" in e.value.message


def test_client_file_information_edges_and_after_close(pool, tmp_path):
    client, loader = pool
    own = ClientEngine(client.address)                 # a second client: closing it leaves the pool
    check_file_information_edges(own, loader, tmp_path)
    own.close()
    with pytest.raises(AsException) as e:
        own.get_file_information(loader.graph_path, loader.weights_path)
    assert e.value.status == AsStatus.ALLSPARK_INVALID_CALL_ERROR and "close" in e.value.message
