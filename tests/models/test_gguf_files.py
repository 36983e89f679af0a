"""Which paths are GGUF models, and bad GGUF files: a wrong magic, a truncated file (header or data), a tensor type
id no GGML type has, a tensor type we cannot serve, an architecture we do not serve, a folder of several files.
Each is refused with an error naming the file and the problem, and nothing is written; a failure while writing the
model files leaves none behind."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_writer import write_gguf

from allspark_server import HuggingFaceModel
from allspark_server.loader import model_file
from allspark_server.loader.gguf_reader import find_gguf
from allspark_server.loader.hf_model import ModelSerializerException
from allspark_server.loader.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    """A tiny Llama (Q8_0 weights, F32 embedding) written as a GGUF file, with its tokenizer."""
    d = str(tmp_path_factory.mktemp("gguf_good"))
    model = build_tiny_model(d, "llama_mha_tied", num_layers=1)
    path = write_gguf(model, os.path.join(d, "tiny.gguf"), weight_type=T.Q8_0, tokenizer_dir=d)
    return path


def refused(path: str, out_dir, match: str) -> None:
    """Loading and serializing `path` fails naming it and `match`, and writes nothing into out_dir."""
    with pytest.raises(ModelSerializerException, match=match) as e:
        HuggingFaceModel(str(path), "bad").load_model().serialize(None, model_output_dir=str(out_dir))
    assert os.path.basename(str(path)) in str(e.value)
    assert not os.path.exists(out_dir) or os.listdir(out_dir) == []


def copy_with(good: str, tmp_path, edit) -> str:
    data = bytearray(open(good, "rb").read())
    data = edit(data)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return str(path)


def test_the_good_file_serializes(good, tmp_path):
    loader = HuggingFaceModel(good, "good", user_set_data_type="float32").load_model()
    loader.serialize(None, model_output_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["good.asgraph", "good.asparam"]


def test_wrong_magic(good, tmp_path):
    refused(copy_with(good, tmp_path, lambda d: b"GGML" + d[4:]), tmp_path / "out", "is not a GGUF file.*b'GGML'")


@pytest.mark.parametrize("keep", [0.5, 0.98], ids=["header", "tensor_data"])
def test_truncated(good, tmp_path, keep):
    """Cut inside the metadata (the tokenizer's strings) or inside the last tensor's data."""
    size = os.path.getsize(good)
    refused(copy_with(good, tmp_path, lambda d: d[:int(size * keep)]), tmp_path / "out", "truncated")


def _type_offset(path: str, tensor: str) -> int:
    """Where the tensor info of `tensor` keeps its type id (a uint32) in the file: after its name (a u64 length and
    the bytes), its dim count (u32) and dims (u64 each)."""
    data = open(path, "rb").read()
    name = tensor.encode()
    at = data.index(np.uint64(len(name)).tobytes() + name) + 8 + len(name)
    return at + 4 + 8 * int(np.frombuffer(data, np.uint32, 1, at)[0])


def test_unknown_tensor_type_id(good, tmp_path):
    at = _type_offset(good, "blk.0.attn_v.weight")

    def patch(d):
        d[at:at + 4] = np.uint32(99).tobytes()
        return d
    refused(copy_with(good, tmp_path, patch), tmp_path / "out", "'blk.0.attn_v.weight' has type id 99")


def test_a_type_we_cannot_serve_is_named_with_its_tensor(tmp_path):
    """Q8_1 is one of llama.cpp's activation types, never a weight's."""
    model = build_tiny_model(str(tmp_path), "llama_mha_tied", num_layers=1, tokenizer=False)
    path = write_gguf(model, str(tmp_path / "q8_1.gguf"),
                      type_for=lambda name: T.Q8_1 if name == "blk.0.ffn_down.weight" else None)
    refused(path, tmp_path / "out", "'blk.0.ffn_down.weight' is of GGML type Q8_1, which allspark cannot serve")


def test_unknown_architecture(tmp_path):
    import gguf
    path = str(tmp_path / "mamba.gguf")
    w = gguf.GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(path, tmp_path / "out", "GGUF architecture 'mamba' is not supported; supported: gemma2, gemma3, llama, "
                                    "qwen2, qwen2moe, qwen3, qwen3moe")


def test_which_paths_are_gguf_models(good, tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(good, folder / "m.gguf")
    assert find_gguf(str(folder)) == str(folder / "m.gguf") and find_gguf(good) == good
    assert HuggingFaceModel(str(folder), "one").path == str(folder / "m.gguf")
    (folder / "config.json").write_text("{}")                     # a HF folder stays one
    assert find_gguf(str(folder)) is None
    os.remove(folder / "config.json")
    shutil.copy(good, folder / "n.gguf")
    with pytest.raises(ModelSerializerException, match="holds 2 GGUF files \\(m.gguf, n.gguf\\)"):
        HuggingFaceModel(str(folder), "two")
    with pytest.raises(ModelSerializerException, match="is not a local folder or .gguf file"):
        HuggingFaceModel(str(tmp_path / "missing.gguf"), "none")


def test_a_failure_while_writing_leaves_no_model_files(good, tmp_path, monkeypatch):
    loader = HuggingFaceModel(good, "half", user_set_data_type="float32").load_model()

    def fail(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(model_file, "_write_graph", fail)
    with pytest.raises(OSError, match="disk full"):
        loader.serialize(None, model_output_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_requantizing_an_already_quantized_gguf_is_refused(good, tmp_path):
    loader = HuggingFaceModel(good, "q", user_set_data_type="float32").load_model()
    with pytest.raises(ModelSerializerException, match="already quantized \\(GGUF\\)"):
        loader.serialize(None, model_output_dir=str(tmp_path), enable_quant=True)
    assert torch.is_tensor(loader._tensors["model.layers.0.self_attn.q_proj.qweight"])
