"""Weights and quantization configs refused at load (issue 47 §3): a NaN or inf weight (an HF folder, a GGUF file,
GPTQ scales, an .asparam read at install) is refused naming the tensor and where its first bad value is, and a
finite weight beyond the range of the chosen dtype names that dtype; GPTQ's `bits` / `group_size` written as whole
floats (4.0, 64.0) load as their integers, other values are refused naming the key; a group size that does not fit
the packed data names the shapes, not activation order. Nothing is written for a refused model."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_writer import write_gguf
from helpers import serialize
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_quant_models import update_quantization_config, write_gptq_folder

from allspark_client import AsException, AsStatus, TargetDevice
from allspark_server import Engine, HuggingFaceModel
from allspark_server.loader.hf_model import ModelSerializerException
from allspark_server.loader.tiny_model import build_tiny_model

UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny untied Llama folder (no tokenizer: none is needed) and its transformers model."""
    d = str(tmp_path_factory.mktemp("refusals_hf"))
    return SimpleNamespace(hf_dir=d, model=build_tiny_model(d, "llama_gqa_llama3", seed=4, tokenizer=False))


def edited_copy(src: str, dst: str, file: str, edit) -> str:
    """A copy of folder `src` whose safetensors `file` went through edit(tensors) (its metadata kept)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, file)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=meta)
    return dst


def refused(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Loading and serializing `path` fails; nothing is written into out_dir. The message."""
    with pytest.raises(ModelSerializerException) as e:
        HuggingFaceModel(path, "bad", user_set_data_type=dtype).load_model().serialize(None, model_output_dir=out_dir)
    assert not os.path.exists(out_dir) or os.listdir(out_dir) == []
    return str(e.value)


def poke(name: str, index: tuple[int, int], value: float):
    def edit(tensors):
        tensors[name][index] = value
    return edit


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_weight_is_refused_naming_the_tensor(tiny, tmp_path, value):
    folder = edited_copy(tiny.hf_dir, str(tmp_path / "hf"), "model.safetensors", poke(UP, (3, 5), value))
    message = refused(folder, str(tmp_path / "as"))
    assert f"{UP!r}" in message and "1 of its" in message and "[3, 5]" in message and str(value) in message
    assert folder in message


def test_a_weight_beyond_the_dtype_names_the_dtype(tiny, tmp_path):
    """1e6 is finite in the fp32 file and inf in float16 (largest 65504): the message says so; bfloat16 holds it."""
    folder = edited_copy(tiny.hf_dir, str(tmp_path / "hf"), "model.safetensors", poke(UP, (0, 1), 1e6))
    message = refused(folder, str(tmp_path / "as"), dtype="float16")
    assert f"{UP!r}" in message and "beyond the range of float16" in message and "1e+06" in message
    HuggingFaceModel(folder, "ok", user_set_data_type="bfloat16").load_model()


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")     # gguf's quantizer meets the NaN
def test_a_nan_gguf_weight_is_refused_naming_the_tensor(tmp_path):
    """F32 weights and Q8_0 ones (a NaN weight makes its block's fp16 scale NaN) alike."""
    d = str(tmp_path / "hf")
    model = build_tiny_model(d, "llama_mha_tied", num_layers=1, tokenizer=False)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[2, 7] = float("nan")
    for qtype in (T.F32, T.Q8_0):
        path = write_gguf(model, str(tmp_path / f"nan_{qtype.name}.gguf"), weight_type=qtype)
        message = refused(path, str(tmp_path / f"as_{qtype.name}"))
        assert "model.layers.0.mlp.down_proj." in message and "not finite" in message, (qtype, message)
        assert os.path.basename(path) in message


def test_nan_gptq_scales_are_refused_naming_the_tensor(tiny, tmp_path):
    write_gptq_folder(tiny, str(tmp_path / "gptq"), 4, 32, True)
    name = "model.layers.1.self_attn.q_proj.scales"
    folder = edited_copy(str(tmp_path / "gptq"), str(tmp_path / "nan"), "model.safetensors",
                         poke(name, (0, 1), float("nan")))
    message = refused(folder, str(tmp_path / "as"))
    assert f"{name!r}" in message and "[0, 1]" in message and "nan" in message


def test_an_asparam_with_a_nan_weight_is_refused_at_install(tiny, tmp_path):
    """A model file written before the loaders refused NaN (here: edited after serializing) fails to install, naming
    the tensor; the engine goes on serving the model it has."""
    loader = serialize(tiny.hf_dir, "good", str(tmp_path / "as"))
    bad_dir = edited_copy(str(tmp_path / "as"), str(tmp_path / "bad"), "good.asparam", poke(UP, (4, 4), float("nan")))
    engine = Engine()
    try:
        def cfg(name, graph, weights):
            return (loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=2)
                    .model_file_path(graph, weights).max_length(64).build())
        engine.install_model(cfg("good", loader.graph_path, loader.weights_path))
        with pytest.raises(AsException) as e:
            engine.install_model(cfg("bad", *(os.path.join(bad_dir, "good" + ext) for ext in (".asgraph", ".asparam"))))
        assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR
        assert UP in e.value.message and "[4, 4]" in e.value.message and "good.asparam" in e.value.message
        assert engine.start_model("good") == AsStatus.ALLSPARK_SUCCESS
        status, handle, queue = engine.start_request("good", {"input_ids": [5, 6, 7]},
                                                     {"top_k": 1, "max_new_tokens": 2})
        assert status == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        queue._wait_terminal()
        engine.release_request("good", handle)
    finally:
        engine.shutdown()


# ---- GPTQ quantization_config ------------------------------------------------------------------------------------

def gptq_with(tiny, folder: str, group: int, **config) -> str:
    """A GPTQ 4-bit folder packed in groups of `group`, its quantization_config then updated with `config`."""
    write_gptq_folder(tiny, folder, 4, group, True)
    update_quantization_config(folder, **config)
    return folder


def stored(out_dir: str, name: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out_dir, name + ".asparam"))


def test_gptq_whole_number_floats_load_as_their_integers(tiny, tmp_path):
    """bits 4.0 and group_size 64.0 (a JSON writer's whole floats) give the very tensors bits 4 / group_size 64 do;
    other values that are no whole number are refused naming the key."""
    out = str(tmp_path / "as")
    serialize(gptq_with(tiny, str(tmp_path / "ints"), 64), "ints", out)
    serialize(gptq_with(tiny, str(tmp_path / "floats"), 64, bits=4.0, group_size=64.0), "floats", out)
    want, got = stored(out, "ints"), stored(out, "floats")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    cfg = HuggingFaceModel(str(tmp_path / "floats"), "f").prequant
    assert (cfg.bits, cfg.group_size) == (4, 64) and all(type(v) is int for v in (cfg.bits, cfg.group_size))
    for i, (key, value) in enumerate([("bits", 4.5), ("group_size", 64.5), ("bits", True), ("group_size", "64")]):
        folder = gptq_with(tiny, str(tmp_path / f"bad{i}"), 64, **{key: value})
        with pytest.raises(ModelSerializerException) as e:
            HuggingFaceModel(folder, "bad")
        assert f"quantization_config.{key} {value!r}" in str(e.value)


def test_gptq_group_size_that_does_not_fit_the_data_names_the_shapes(tiny, tmp_path):
    """Packed in groups of 64, configured as 32: the scales hold half the groups the config implies. The message
    gives the shapes and the group size they imply, and does not blame activation order; a g_idx that reorders the
    inputs (shapes fine) still is the activation-order case, named as such."""
    folder = gptq_with(tiny, str(tmp_path / "gptq"), 64, group_size=32)
    message = refused(folder, str(tmp_path / "as"))
    assert "activation" not in message and "desc_act" not in message
    assert "scales (2, 64)" in message and "group_size 32" in message and "group_size is 64" in message
    name = "model.layers.0.mlp.down_proj.g_idx"

    def reverse(tensors):
        tensors[name] = tensors[name].flip(0).contiguous()
    folder = edited_copy(gptq_with(tiny, str(tmp_path / "ok"), 32), str(tmp_path / "act"), "model.safetensors", reverse)
    message = refused(folder, str(tmp_path / "as"))
    assert "model.layers.0.mlp.down_proj" in message and "out of order" in message and "desc_act" in message
