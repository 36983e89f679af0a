"""FP8 checkpoints in their published layouts (quant/fp8_checkpoint.py), written here by our own packer from the
formats' descriptions: transformers' FineGrainedFP8 (`fp8`, block scales `weight_scale_inv`), compressed-tensors
(per channel and per tensor `weight_scale`, an `ignore` list) and FBGEMM's. Serializing keeps every weight's
e4m3 bytes as they are and maps the scales exactly; a CPU rank refuses the model; broken layers are refused
naming them. Serving on a GPU (greedy against transformers on the same weights): tests/gpu/test_cuda.py."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors import safe_open
from test_quant_models import QUANTIZED, dequantize_here, save_quantized_folder, update_quantization_config

from allspark_client import AsException
from allspark_server import Engine, HuggingFaceModel
from allspark_server.loader.hf_model import ModelSerializerException
from allspark_server.loader.model_file import read_model_graph

BLOCK = (16, 32)          # weight_block_size [rows, inputs]: the tiny model's 32-row k/v take two block rows


def e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 values (already within +-448) -> float8_e4m3fn, to nearest even (torch's cast)."""
    return values.clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_layer(w: torch.Tensor, layout: str, block_scale: str = "weight_scale_inv") -> tuple[dict, torch.Tensor]:
    """w [N, K] as a published FP8 layer: (its tensors, the fp32 weight they stand for, computed here); block
    scales are named `block_scale` (FineGrainedFP8's weight_scale_inv, compressed-tensors' weight_scale)."""
    n, k = w.shape
    if layout == "block":
        bn, bk = BLOCK
        blocks = torch.nn.functional.pad(w, (0, 0, 0, -n % bn)).reshape(-(-n // bn), bn, k // bk, bk)
        scale = blocks.abs().amax((1, 3)) / 448                                   # [N / bn, K / bk]
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)         # each element's block scale
        weight = e4m3(w / full)
        return {"weight": weight, block_scale: scale}, weight.float() * full
    scale = w.abs().amax(1, keepdim=True) / 448 if layout == "channel" else w.abs().amax().reshape(1) / 448
    weight = e4m3(w / scale)
    return {"weight": weight, "weight_scale": scale}, weight.float() * scale


def quant_config(layout: str, method: str, ignore: list[str]) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(BLOCK), "modules_to_not_convert": ignore}
    if method == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ignore}
    weights = {"num_bits": 8, "type": "float", "strategy": layout, "symmetric": True, "dynamic": False}
    if layout == "block":
        weights["block_structure"] = list(BLOCK)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token", "dynamic": True}}}}


def write_fp8_folder(tm, out_dir: str, layout: str, method: str, ignore: tuple[str, ...] = (),
                     mutate=None) -> tuple[torch.nn.Module, dict[str, dict[str, torch.Tensor]]]:
    """The tiny model's folder with its GEMM layers (all but those `ignore` names) as FP8 layers: the transformers
    model with those weights dequantized, and each FP8 layer's tensors. `mutate(base, parts)` may break one."""
    shutil.copytree(tm.hf_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "config.json"))
    reference, tensors, layers = copy.deepcopy(tm.model), {}, {}
    with torch.no_grad():
        for name, t in tm.model.state_dict().items():
            base = name[:-len(".weight")]
            if name.endswith(".weight") and base.rsplit(".", 1)[-1] in QUANTIZED and \
                    not any(base.endswith(i) for i in ignore):
                parts, dequant = fp8_layer(t.float(), layout,
                                           "weight_scale_inv" if method == "fp8" else "weight_scale")
                if mutate:
                    mutate(base, parts)
                layers[base] = parts
                tensors.update({f"{base}.{p}": v.contiguous() for p, v in parts.items()})
                reference.get_submodule(base).weight.copy_(dequant)
            else:
                tensors[name] = t.contiguous()
    save_quantized_folder(tm, out_dir, tensors, quant_config(layout, method, list(ignore)))
    return reference, layers


CASES = [("block", "fp8"), ("channel", "compressed-tensors"), ("tensor", "compressed-tensors"),
         ("block", "compressed-tensors"), ("channel", "fbgemm_fp8")]


@pytest.mark.parametrize("layout,method", CASES)
def test_fp8_checkpoint_keeps_its_codes_and_scales(llama, tmp_path, layout, method):
    """Every layer's stored codes are the checkpoint's e4m3 bytes, and the stored weight (codes x scales, read back
    here) is the one the checkpoint stands for, bit for bit; the model info names the format."""
    folder = str(tmp_path / "fp8")
    reference, layers = write_fp8_folder(llama, folder, layout, method)
    loader = HuggingFaceModel(folder, "fp8ckpt", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    group = BLOCK[1] if layout == "block" else -1
    with safe_open(loader.weights_path, framework="pt") as f:
        assert len(layers) == 7 * reference.config.num_hidden_layers
        for base, parts in layers.items():
            assert torch.equal(f.get_tensor(base + ".qweight"), parts["weight"].view(torch.uint8))
            assert torch.equal(dequantize_here(f, base, "fp8_e4m3", group),
                               reference.get_submodule(base).weight.float())
    scheme = read_model_graph(loader.graph_path, loader.weights_path).quant
    assert (scheme.weight_format, scheme.group_size, scheme.compute_method) == ("fp8_e4m3", group, "weight_only")


def test_ignored_layers_stay_dense_and_a_cpu_rank_refuses_the_model(llama, tmp_path):
    folder = str(tmp_path / "fp8")
    reference, layers = write_fp8_folder(llama, folder, "channel", "compressed-tensors", ignore=("mlp.down_proj",))
    assert not any(base.endswith("down_proj") for base in layers)
    loader = HuggingFaceModel(folder, "fp8ign", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    with safe_open(loader.weights_path, framework="pt") as f:
        down = "model.layers.0.mlp.down_proj"
        assert down + ".qweight" not in f.keys()
        assert torch.equal(f.get_tensor(down + ".weight"), reference.get_submodule(down).weight)
    cfg = (loader.create_reference_runtime_config_builder("fp8ign", "cpu", [0], max_batch=2).max_length(64)
           .kv_cache_span_size(16).build())
    with pytest.raises(AsException, match="fp8_e4m3 weights cannot be served here: this rank runs on a CPU"):
        Engine().install_model(cfg)


def _nan_code(base, parts):
    if base.endswith("layers.1.self_attn.o_proj"):
        parts["weight"].view(torch.uint8)[3, 5] = 0x7F


def _short_scale(base, parts):
    if base.endswith("layers.0.mlp.up_proj"):
        parts["weight_scale"] = parts["weight_scale"][:-1]


def _bf16_weight(base, parts):
    if base.endswith("layers.0.self_attn.k_proj"):
        parts["weight"] = parts["weight"].to(torch.bfloat16)


@pytest.mark.parametrize("mutate,match", [
    (_nan_code, r"tensor 'model\.layers\.1\.self_attn\.o_proj\.weight': 1 of its 4096 values is not finite"),
    (_short_scale, r"layers\.0\.mlp\.up_proj: weight_scale \(127, 1\) is neither one scale nor one a row"),
    (_bf16_weight, r"layers\.0\.self_attn\.k_proj: weight is torch\.bfloat16"),
])
def test_broken_fp8_layers_are_refused_naming_them(llama, tmp_path, mutate, match):
    folder = str(tmp_path / "fp8")
    write_fp8_folder(llama, folder, "channel", "compressed-tensors", mutate=mutate)
    with pytest.raises(ModelSerializerException, match=match):
        HuggingFaceModel(folder, "bad", user_set_data_type="float32").load_model()


@pytest.mark.parametrize("change,match", [
    ({"weight_block_size": [128, 48]}, r"a block's 48 inputs are not one of allspark's group sizes"),
    ({"fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
])
def test_unsupported_fp8_configs_are_refused(llama, tmp_path, change, match):
    folder = str(tmp_path / "fp8")
    write_fp8_folder(llama, folder, "block", "fp8")
    update_quantization_config(folder, **change)
    with pytest.raises(ModelSerializerException, match=match):
        HuggingFaceModel(folder, "bad")
