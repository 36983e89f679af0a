"""LoRA adapter files (allspark_server/lora/): PEFT folders read for the decoder; every tensor-parallel rank's shard of
every fused projection against PEFT's own per-module deltas (fp64, world sizes 1 and 2); .aslora round trips;
DashInfer's lora_cfg through both serialize entry points; and each refusal naming its problem."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from allspark_server import HuggingFaceModel, ModelSerializerException
from allspark_server.collective.comm import LocalComm
from allspark_server.layers.sharding import SplitMode, TPLayout
from allspark_server.loader.tiny_model import build_tiny_model
from allspark_server.loader.torch_state import serialize_model_from_torch
from allspark_server.lora import PROJECTIONS, LoraAdapterError, fused_rank_shard, load_adapter, save_aslora
from allspark_server.models.decoder import model_class_and_rules

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the decoder's fused projections: (sublayer, parts with their base weights' split), as layers/sharding.py splits them
FUSED = {"qkv_proj": ("self_attn", [("q_proj", SplitMode.HEADS), ("k_proj", SplitMode.KV_HEADS),
                                    ("v_proj", SplitMode.KV_HEADS)]),
         "o_proj": ("self_attn", [("o_proj", SplitMode.ROW_HEADS)]),
         "gate_up_proj": ("mlp", [("gate_proj", SplitMode.COLUMN), ("up_proj", SplitMode.COLUMN)]),
         "down_proj": ("mlp", [("down_proj", SplitMode.ROW)])}
# name -> (tiny variant, LoraConfig arguments, the adapter's largest r)
CASES = {
    "llama_r8": ("llama_gqa_llama3", dict(r=8, lora_alpha=16, target_modules=SEVEN), 8),
    # q/k/v biases; k and gate untargeted (their rows of B stay zero); per-module r and alpha
    "qwen2_r16_patterns": ("qwen2_bias_tied", dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj",
                                                                                        "down_proj"],
                                                   rank_pattern={"layers.1.self_attn.v_proj": 4},
                                                   alpha_pattern={"up_proj": 8}), 16),
    # one KV head, which each of 2 ranks holds a copy of
    "mqa_rslora": ("llama_mqa", dict(r=8, lora_alpha=16, target_modules=SEVEN, use_rslora=True), 8),
}


@dataclasses.dataclass
class Made:
    hf_dir: str
    args: object
    peft: torch.nn.Module      # the PEFT model, in float64
    adapter_dir: str


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> Made, each tiny model and its adapter built once."""
    root, cache = tmp_path_factory.mktemp("lora"), {}

    def get(name: str) -> Made:
        if name not in cache:
            variant, lora, _ = CASES[name]
            hf_dir, adapter_dir = str(root / f"{name}-model"), str(root / "adapters" / name)
            model = build_tiny_model(hf_dir, variant, seed=1, tokenizer=False)
            torch.manual_seed(2)
            peft = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
            peft.save_pretrained(adapter_dir)
            cache[name] = Made(hf_dir, HuggingFaceModel(hf_dir, name).args, peft.double().eval(), adapter_dir)
        return cache[name]
    return get


def peft_delta(peft, module: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's own delta of one module on x: the LoRA layer's output less its base layer's (zero where untargeted)."""
    layer = peft.base_model.model.get_submodule(module)
    if not hasattr(layer, "base_layer"):
        return torch.zeros(x.shape[0], layer.out_features, dtype=x.dtype)
    with torch.no_grad():
        return layer(x) - layer.base_layer(x)


def decoder_modules(args, tp: TPLayout, layer: int) -> dict:
    """The decoder's own projection modules of one layer for this rank (meta tensors: their shapes)."""
    cls, _ = model_class_and_rules(args.architecture)
    with torch.device("meta"):
        model = cls(args, tp, LocalComm(), torch.float32, max_positions=1)
    block = model.model.layers[layer]
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


@pytest.mark.parametrize("case", CASES)
def test_every_rank_shard_equals_peft_deltas(made, case):
    """For world sizes 1 and 2, each rank's x_local @ A_local.T @ B_local.T is its share of PEFT's delta: the rows
    of each part the base weight gives the rank (column-parallel), or a partial whose sum over ranks is the delta
    (row-parallel); shapes are the decoder's fused modules'."""
    m = made(case)
    adapter = load_adapter(m.adapter_dir, m.args)
    assert (adapter.name, adapter.rank) == (case, CASES[case][2])
    torch.manual_seed(3)
    for layer in range(m.args.num_layers):
        prefix = f"model.layers.{layer}"
        inputs = {sub: torch.randn(5, m.args.hidden_size, dtype=torch.float64) for sub in ("self_attn", "mlp")}
        inputs["o_proj"] = torch.randn(5, m.args.num_heads * m.args.head_dim, dtype=torch.float64)
        inputs["down_proj"] = torch.randn(5, m.args.intermediate_size, dtype=torch.float64)
        for projection, (sub, parts) in FUSED.items():
            x = inputs.get(projection, inputs[sub])
            deltas = {p: peft_delta(m.peft, f"{prefix}.{sub}.{p}", x) for p, _ in parts}
            weights = {p: tuple(m.peft.base_model.model.get_submodule(f"{prefix}.{sub}.{p}").weight.shape)
                       for p, _ in parts}
            for world in (1, 2):
                total = torch.zeros_like(next(iter(deltas.values())))
                for rank in range(world):
                    tp = TPLayout.for_model(m.args, rank, world)
                    module = decoder_modules(m.args, tp, layer)[projection]
                    shard = fused_rank_shard(adapter, tp, layer, projection, torch.float64)
                    where = f"{case} layer {layer} {projection} rank {rank}/{world}"
                    if shard is None:
                        assert all(not d.any() for d in deltas.values()), where
                        continue
                    a, b = shard
                    assert a.dtype == b.dtype == torch.float64, where
                    assert a.shape[1] == module.in_features and b.shape == (module.out_features, a.shape[0]), where
                    if len(parts) == 1 and parts[0][1] in (SplitMode.ROW, SplitMode.ROW_HEADS):
                        dim, lo, hi = tp.slice_for(parts[0][1], weights[parts[0][0]])
                        total += (x[:, lo:hi] if dim == 1 else x) @ a.T @ b.T
                        continue
                    outs = (x @ a.T @ b.T).split(module.part_sizes, dim=-1)
                    for (p, mode), out in zip(parts, outs):
                        dim, lo, hi = tp.slice_for(mode, weights[p])
                        want = deltas[p][:, lo:hi] if dim == 0 else deltas[p]
                        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=f"{where} {p}")
                if len(parts) == 1 and parts[0][1] in (SplitMode.ROW, SplitMode.ROW_HEADS):
                    torch.testing.assert_close(total, deltas[parts[0][0]], rtol=1e-5, atol=1e-6,
                                               msg=f"{case} layer {layer} {projection} on {world} ranks")


def test_bin_folder_and_aslora_round_trip(made, tmp_path):
    """adapter_model.bin reads as its safetensors twin; an .aslora file gives back identical tensors and scales."""
    m = made("qwen2_r16_patterns")
    ref = load_adapter(m.adapter_dir, m.args)
    m.peft.float().save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    m.peft.double()
    assert os.listdir(tmp_path / "bin").count("adapter_model.bin") == 1
    path = str(tmp_path / "out" / "mine.aslora")
    save_aslora(ref, path)
    for other, name in ((load_adapter(str(tmp_path / "bin"), m.args), "bin"), (load_adapter(path, m.args), "mine")):
        assert (other.name, other.rank, other.base) == (name, ref.rank, ref.base)
        assert list(other.modules) == list(ref.modules)
        for module, (a, b, scale) in ref.modules.items():
            oa, ob, oscale = other.modules[module]
            assert oa.dtype == ob.dtype == torch.float32 and torch.equal(oa, a) and torch.equal(ob, b), module
            assert oscale == scale, module
    assert ref.modules["model.layers.1.self_attn.v_proj"][0].shape[0] == 4          # rank_pattern
    assert ref.modules["model.layers.0.mlp.up_proj"][2] == 8 / 16                     # alpha_pattern


def test_lora_cfg_writes_aslora_files_through_both_entry_points(made, tmp_path):
    """serialize(lora_cfg) writes <dir>/<name>.aslora beside the model files (lora_only: alone), as does
    serialize_model_from_torch; unknown keys are refused by name before anything is written."""
    m = made("llama_r8")
    root = os.path.dirname(m.adapter_dir)
    shutil.copytree(m.adapter_dir, os.path.join(root, "second"), dirs_exist_ok=True)
    cfg = {"input_base_dir": root, "lora_names": ["llama_r8", "second"], "lora_only": False}
    loader = HuggingFaceModel(m.hf_dir, "base", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "all"), lora_cfg=cfg)
    assert sorted(os.listdir(tmp_path / "all")) == ["base.asgraph", "base.asparam", "llama_r8.aslora", "second.aslora"]
    ref = load_adapter(m.adapter_dir, m.args)
    mine = load_adapter(str(tmp_path / "all" / "second.aslora"), m.args)
    assert mine.name == "second" and all(torch.equal(mine.modules[k][1], v[1]) for k, v in ref.modules.items())
    HuggingFaceModel(m.hf_dir, "base").serialize(None, model_output_dir=str(tmp_path / "only"),
                                                 lora_cfg=dict(cfg, lora_only=True))
    assert sorted(os.listdir(tmp_path / "only")) == ["llama_r8.aslora", "second.aslora"]
    with open(os.path.join(m.hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    state = load_file(os.path.join(m.hf_dir, "model.safetensors"))
    serialize_model_from_torch("t", "LlamaForCausalLM", state, hf_cfg, str(tmp_path / "torch"),
                               lora_cfg=dict(cfg, lora_names=["second"]))
    assert sorted(os.listdir(tmp_path / "torch")) == ["second.aslora", "t.asgraph", "t.asparam"]
    serialize_model_from_torch("t", "LlamaForCausalLM", state, hf_cfg, str(tmp_path / "torch_only"),
                               lora_cfg=dict(cfg, lora_only=True))
    assert sorted(os.listdir(tmp_path / "torch_only")) == ["llama_r8.aslora", "second.aslora"]
    bad = [(dict(cfg, bogus=1), "'bogus'"), (dict(cfg, lora_names="second"), "lora_names"),
           ({"lora_names": ["second"]}, "'input_base_dir'"), (dict(cfg, lora_names=["nope"]), "nope"),
           (dict(cfg, lora_only="yes"), "lora_only")]
    for lora_cfg, named in bad:
        with pytest.raises(ModelSerializerException, match=f"lora_cfg: .*{named}"):
            loader.serialize(None, model_output_dir=str(tmp_path / "bad"), lora_cfg=lora_cfg)
        with pytest.raises(ModelSerializerException, match=f"lora_cfg: .*{named}"):
            serialize_model_from_torch("t", "LlamaForCausalLM", state, hf_cfg, str(tmp_path / "bad"),
                                       lora_cfg=lora_cfg)
    assert not os.path.exists(tmp_path / "bad")


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _edit(cfg: dict | None = None, drop=(), add=None, rename=None, change=None):
    """A refusal case's change to the adapter folder: config keys set, tensors dropped, added, renamed or changed."""
    def apply(folder: str):
        path = os.path.join(folder, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(cfg or {})
        with open(path, "w") as f:
            json.dump(config, f)
        file = os.path.join(folder, "adapter_model.safetensors")
        tensors = load_file(file)
        for key in drop:
            del tensors[key]
        if rename:
            tensors = {k.replace(*rename): v for k, v in tensors.items()}
        if change:
            key, fn = change
            tensors[key] = fn(tensors[key])
        tensors.update(add or {})
        save_file(tensors, file)
    return apply


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _write(name: str, text: bytes):
    def apply(folder: str):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(text)
    return apply


def _remove(name: str):
    return lambda folder: os.remove(os.path.join(folder, name))


# id -> (change to a good llama adapter folder, what the message must name)
REFUSALS = {
    "no_config": (_remove("adapter_config.json"), ["adapter_config.json"]),
    "bad_json": (_write("adapter_config.json", b"{"), ["adapter_config.json", "cannot be read"]),
    "no_weights": (_remove("adapter_model.safetensors"), ["adapter_model.safetensors", "adapter_model.bin"]),
    "damaged_weights": (_write("adapter_model.safetensors", b"\x08\x00junk"), ["adapter_model.safetensors",
                                                                                "cannot be read"]),
    "peft_type": (_edit({"peft_type": "IA3"}), ["peft_type 'IA3'"]),
    "bias": (_edit({"bias": "lora_only"}), ["bias 'lora_only'"]),
    "dora": (_edit({"use_dora": True}), ["use_dora", "DoRA"]),
    "lora_bias": (_edit({"lora_bias": True}), ["lora_bias"]),
    "modules_to_save": (_edit({"modules_to_save": ["lm_head"]}), ["modules_to_save", "lm_head"]),
    "pissa": (_edit({"init_lora_weights": "pissa"}), ["init_lora_weights 'pissa'", "base model's weights"]),
    "unknown_key": (_edit({"new_variant_config": {"x": 1}}), ["new_variant_config"]),
    "target_lm_head": (_edit({"target_modules": SEVEN + ["lm_head"]}), ["target_modules", "'lm_head'"]),
    "lm_head_tensor": (_edit(add={"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                                  "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 8)}),
                       ["module 'lm_head'"]),
    "dora_magnitude": (_edit(add={f"{Q0}.lora_magnitude_vector": torch.ones(64)}),
                       [f"'{Q0}.lora_magnitude_vector'"]),
    "layers_to_transform": (_edit({"layers_to_transform": [0, 5]}), ["layers_to_transform", "layer 5", "2 layers"]),
    "layer_outside": (_edit(rename=("layers.1.", "layers.7.")), ["model.layers.7.", "layer 7", "2 layers"]),
    "shape": (_edit(change=(f"{Q0}.lora_A.weight", lambda t: t[:, :32].contiguous())),
              [f"'{Q0}.lora_A.weight'", "[8, 32]", "expected [8, 64]"]),
    "rank_pattern": (_edit({"rank_pattern": {"q_proj": 4}}), [f"'{Q0}.lora_A.weight'", "[8, 64]", "expected [4, 64]"]),
    "a_without_b": (_edit(drop=[f"{Q0}.lora_B.weight"]), [f"'{Q0}.lora_A.weight'", "no lora_B"]),
    "int_tensor": (_edit(change=(f"{Q0}.lora_A.weight", lambda t: t.to(torch.int32))),
                   [f"'{Q0}.lora_A.weight'", "int32", "not floating point"]),
    "nan": (_edit(change=(f"{Q0}.lora_B.weight", _nan)), [f"'{Q0}.lora_B.weight'", "not finite"]),
    "moe_expert_tensor": (_edit(rename=("layers.0.mlp.gate_proj", "layers.0.mlp.experts.0.gate_proj")),
                          ["model.layers.0.mlp.experts.0.gate_proj", "mixture-of-experts"]),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_adapter_folders_are_refused_naming_the_problem(made, tmp_path, case):
    m = made("llama_r8")
    folder = str(tmp_path / "adapter")
    shutil.copytree(m.adapter_dir, folder)
    change, named = REFUSALS[case]
    change(folder)
    with pytest.raises(LoraAdapterError) as e:
        load_adapter(folder, m.args)
    assert all(n in str(e.value) for n in named), (named, str(e.value))


@pytest.mark.parametrize("architecture", ["ChatGLMModel", "GlmForCausalLM", "QWenLMHeadModel", "BaichuanForCausalLM"])
def test_families_whose_converters_move_projection_weights_are_refused(made, architecture):
    m = made("llama_r8")
    with pytest.raises(LoraAdapterError, match=f"not supported for {architecture}"):
        load_adapter(m.adapter_dir, dataclasses.replace(m.args, architecture=architecture))


def test_moe_mlps_other_models_and_files_are_refused(made, tmp_path):
    """An MoE layer's MLP, an .aslora made for another model, a file that is not one, a path that is nothing, and a
    rank layout unlike the adapter's model."""
    m = made("llama_r8")
    moe = dataclasses.replace(m.args, architecture="Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=48, moe_layers=(0,))
    with pytest.raises(LoraAdapterError, match=r"'model\.layers\.0\.mlp\.down_proj'.*mixture of experts"):
        load_adapter(m.adapter_dir, moe)
    ref = load_adapter(m.adapter_dir, m.args)
    path = str(tmp_path / "a.aslora")
    save_aslora(ref, path)
    with pytest.raises(LoraAdapterError, match=r"another model: intermediate_size 128 \(the model's: 256\)"):
        load_adapter(path, dataclasses.replace(m.args, intermediate_size=256))
    plain = str(tmp_path / "plain.aslora")
    shutil.copy(os.path.join(m.adapter_dir, "adapter_model.safetensors"), plain)
    with pytest.raises(LoraAdapterError, match="is not an .aslora file"):
        load_adapter(plain, m.args)
    with pytest.raises(LoraAdapterError, match="does not exist"):
        load_adapter(str(tmp_path / "missing"), m.args)
    other = TPLayout.for_model(dataclasses.replace(m.args, intermediate_size=256), 0, 2)
    with pytest.raises(LoraAdapterError, match="intermediate_size 128"):
        fused_rank_shard(ref, other, 0, PROJECTIONS[0], torch.float32)
