"""DashInfer's `serialize_model_from_torch` (loader/torch_state.py) writes the files HuggingFaceModel.serialize writes
for the same weights (tensors bit for bit, the same model args and split modes), honours or refuses each argument by
name, and in a client without allspark_server imported (torch-free) only says what it needs; v1's save_model and
reset_stream on their edges."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import serialize, start_engine
from safetensors.torch import load_file

from allspark_client import AsException, AsStatus
from allspark_client._proto import allspark_pb2 as pb
from allspark_server import Engine, HuggingFaceModel, ModelSerializerException


def graph(path: str) -> pb.ModelGraph:
    g = pb.ModelGraph()
    with open(path, "rb") as f:
        g.ParseFromString(f.read())
    return g


def assert_same_files(ours: tuple[str, str], theirs: tuple[str, str]) -> None:
    a, b = graph(ours[0]), graph(theirs[0])
    assert json.loads(a.model_args_json) == json.loads(b.model_args_json)
    assert {t.name: (list(t.shape), t.dtype, t.split_mode) for t in a.tensors} == \
        {t.name: (list(t.shape), t.dtype, t.split_mode) for t in b.tensors}
    assert (a.dtype, list(a.generation.eos_token_ids)) == (b.dtype, list(b.generation.eos_token_ids))
    assert json.loads(a.quantization or "null") == json.loads(b.quantization or "null")
    ta, tb = load_file(ours[1]), load_file(theirs[1])
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


def dashinfer_config(model, model_type: str) -> dict:
    """The model_config DashInfer's HuggingFaceModel builds: the HF config dict, its model_type replaced by
    DashInfer's tag, plus size_per_head and rotary_emb_base."""
    cfg = model.config.to_dict()
    theta = (cfg.get("rope_parameters") or cfg).get("rope_theta", 10000.0)
    cfg.update(model_type=model_type, size_per_head=cfg["hidden_size"] // cfg["num_attention_heads"],
               rotary_emb_base=theta)
    return cfg


def convert(engine, model, name: str, model_type: str, out: str, **kw) -> tuple[str, str]:
    cfg = dashinfer_config(model, model_type)
    kw.setdefault("rotary_base", cfg["rotary_emb_base"])
    return engine.serialize_model_from_torch(name, model_type, model.state_dict(), cfg, out, **kw)


@pytest.fixture(scope="module")
def engine():
    e = Engine()
    yield e
    e.close()


@pytest.mark.parametrize("variant,model_type", [("llama_gqa_llama3", "LLaMA_v3"), ("qwen2_bias_tied", "Qwen_v20")])
def test_same_files_as_hugging_face_model(tiny_models, engine, tmp_path, variant, model_type):
    tiny = tiny_models[variant]
    ours = convert(engine, tiny.model, "m", model_type, str(tmp_path / "ours"))
    assert ours == (str(tmp_path / "ours" / "m.asgraph"), str(tmp_path / "ours" / "m.asparam"))
    ref = serialize(tiny.hf_dir, "m", str(tmp_path / "ref"))
    assert_same_files(ours, (ref.graph_path, ref.weights_path))
    assert graph(ours[0]).build_meta.serialize_args["model_type"] == model_type


def test_dtype_quantization_and_file_paths(tiny_models, engine, tmp_path):
    """bfloat16 and DashInfer's QuantizeConfig (uint8, sub-channel groups of 64) equal HuggingFaceModel's InstantQuant
    with the same scheme; as_model_path / as_weight_path name the two files."""
    tiny = tiny_models["llama_gqa_llama3"]
    qc = SimpleNamespace(activation_type="bfloat16", weight_type="uint8", extra_option={"SubChannel": True,
                                                                                        "GroupSize": 64})
    paths = (str(tmp_path / "g" / "x.graph"), str(tmp_path / "p" / "x.params"))
    ours = convert(engine, tiny.model, "q", "LLaMA_v3", None, as_model_path=paths[0], as_weight_path=paths[1],
                   data_type="bfloat16", do_dynamic_quantize_convert=True, quant_config=qc)
    assert ours == paths and all(map(os.path.isfile, paths))
    ref = HuggingFaceModel(tiny.hf_dir, "q", user_set_data_type="bfloat16").load_model()
    ref.serialize(None, model_output_dir=str(tmp_path / "ref"), enable_quant=True,
                  customized_quant_config={"weight_format": "uint8", "group_size": 64})
    assert_same_files(ours, (ref.graph_path, ref.weights_path))
    assert json.loads(graph(ours[0]).quantization)["weight_format"] == "uint8"


def test_rotary_base_replaces_the_configs_when_given(tiny_models, engine, tmp_path):
    tiny = tiny_models["llama_gqa_llama3"]              # rope_theta 500000 in its config
    kept = convert(engine, tiny.model, "a", "LLaMA_v3", str(tmp_path), rotary_base=10000.0)   # the default
    given = convert(engine, tiny.model, "b", "LLaMA_v3", str(tmp_path), rotary_base=20000.0)
    assert json.loads(graph(kept[0]).model_args_json)["rope_theta"] == 500000.0
    assert json.loads(graph(given[0]).model_args_json)["rope_theta"] == 20000.0
    assert graph(given[0]).build_meta.serialize_args["rotary_base"] == "20000.0"


def test_qwen_v1_dynamic_ntk_follows_the_arguments(tmp_path, engine):
    """Qwen v1's NTK / logn act past seq_length; DashInfer's arguments decide: on, the model is exact up to
    model_sequence_length (a longer context is refused); off, no limit. The tensors equal the folder's."""
    from remote_layouts import write_qwen1

    from allspark_server.loader.tiny_model import build_tiny_model
    build_tiny_model(str(tmp_path / "qwen2"), "qwen2_mha", tokenizer=False)
    folder = write_qwen1(str(tmp_path / "qwen2"), str(tmp_path / "qwen1"), seq_length=512)
    state = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    on = engine.serialize_model_from_torch("on", "Qwen_v10", state, cfg, str(tmp_path / "on"), use_dynamic_ntk=True,
                                           use_logn_attn=True, model_sequence_length=256)
    off = engine.serialize_model_from_torch("off", "Qwen_v10", state, cfg, str(tmp_path / "off"))
    ref = serialize(folder, "ref", str(tmp_path / "ref"))
    assert json.loads(graph(on[0]).model_args_json)["context_limit"] == 256
    assert json.loads(graph(off[0]).model_args_json)["context_limit"] == 0
    theirs = load_file(ref.weights_path)
    for ours in (load_file(on[1]), load_file(off[1])):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


REFUSALS = [
    (dict(lora_cfg={"input_base_dir": ".", "lora_names": ["x"], "lora_dir": "."}), "lora_cfg.*lora_dir"),  # a typo
    (dict(enable_i8cache_mha=True), "enable_i8cache_mha"),
    (dict(mha_kv_cache_config={"type": "int8"}), "mha_kv_cache_config"),
    (dict(derive_type=None), "derive_type"),
    (dict(seqlen_extrapolation=2.0), "seqlen_extrapolation"),
    (dict(use_dynamic_ntk=True), "use_dynamic_ntk"),
    (dict(use_logn_attn=True), "use_logn_attn"),
    (dict(multigpu_mode=2), "multigpu_mode"),
    (dict(data_type="int8"), "data_type"),
    (dict(quant_config={"weight_format": "int8"}), "quant_config"),
    (dict(do_dynamic_quantize_convert=True, quant_config=SimpleNamespace(activation_type="bfloat16",
                                                                         weight_type="int8",
                                                                         extra_option={"AdaptedQuantMethod": "GPTQ"})),
     "AdaptedQuantMethod"),
    (dict(model_type="GPT2"), "model_type"),
    (dict(model_type="Qwen_v20"), "model_type"),           # the config's architectures says LlamaForCausalLM
    (dict(save_dir=None), "save_dir"),
    (dict(as_model_path="x.asgraph"), "as_weight_path"),
    (dict(torch_model=[1, 2]), "torch_model"),
    (dict(model_name=""), "model_name"),
]


@pytest.mark.parametrize("kwargs,argument", REFUSALS, ids=[a for _, a in REFUSALS])
def test_arguments_it_cannot_honour_are_refused_by_name(tiny_models, engine, tmp_path, kwargs, argument):
    model = tiny_models["llama_gqa_llama3"].model
    args = dict(model_name="m", model_type="LLaMA_v3", torch_model=model.state_dict(),
                model_config=dashinfer_config(model, "LLaMA_v3"), save_dir=str(tmp_path))
    args.update(kwargs)
    with pytest.raises(ModelSerializerException, match=argument):
        engine.serialize_model_from_torch(**args)
    assert os.listdir(tmp_path) == []                  # nothing written


def test_torch_free_client_refuses_saying_it_needs_the_server_package():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from allspark_client import AsException, ClientEngine\n"
            "client = ClientEngine.__new__(ClientEngine)      # no pool needed: the call fails before any RPC\n"
            "try:\n"
            "    client.serialize_model_from_torch('m', 'LLaMA_v2', {}, {}, '/nonexistent')\n"
            "except AsException as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs torch" in out.stdout and "import allspark_server" in out.stdout, out.stdout
    assert "ALLSPARK_RUNTIME_ERROR" in out.stdout, out.stdout


def test_save_model_and_reset_stream_edges(llama, tmp_path):
    loader = serialize(llama.hf_dir, "own", str(tmp_path / "in"))
    engine = start_engine(loader, "own", max_batch=2, max_length=256)
    try:
        assert engine.save_model("nosuch", str(tmp_path / "out")) == AsStatus.ALLSPARK_PARAM_ERROR
        assert "nosuch" in engine.get_last_error()
        assert engine.reset_stream("nosuch") == AsStatus.ALLSPARK_PARAM_ERROR
        assert engine.save_model("own", str(tmp_path / "g"), with_weight=False) == AsStatus.ALLSPARK_SUCCESS
        assert os.listdir(tmp_path / "g") == ["own.asgraph"]
        assert graph(str(tmp_path / "g" / "own.asgraph")) == graph(loader.graph_path)
        with open(loader.weights_path, "r+b") as f:     # the installed weights file changes under the model
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        assert engine.save_model("own", str(tmp_path / "w")) == AsStatus.ALLSPARK_IO_ERROR
        assert "changed" in engine.get_last_error()
        status, handle, queue = engine.start_request("own", {"input_ids": [5, 6, 7]}, {"max_new_tokens": 2})
        with pytest.raises(AsException, match="ResultQueue"):
            engine.get_output_no_wait("own", handle)
        engine.release_request("own", handle)
    finally:
        engine.close()
