"""AWQ (GEMM) checkpoints: a packer written here from the published format (AutoAWQ's WQLinear_GEMM.from_linear,
awq/utils/packing_utils.py) turns a tiny random model's GEMM weights into an AWQ checkpoint; served through the
Engine and a 2-rank pool, its greedy tokens equal transformers running the same weights dequantized here."""
from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import assert_same_tokens, greedy, hf_greedy, installed_on_pool, random_prompt, start_engine
from safetensors.torch import save_file

from allspark_server import HuggingFaceModel
from allspark_server.loader.hf_model import ModelSerializerException
from allspark_server.loader.tiny_model import build_tiny_model
from allspark_server.quant import awq
from allspark_server.quant.formats import dequantize
from allspark_server.quant.scheme import QuantConfigError

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of a word holds column 8c + AWQ_ORDER[i] (the published order)


# ---- the published format, written here -----------------------------------------------------------------------

def awq_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's zero-point quantization of w [N, K]: per group of K, scale = (max - min) / 15 (fp16, as stored),
    zero = clamp(-round(min / scale), 0, 15), code = clamp(round(w / scale) + zero, 0, 15). Returns codes [K, N],
    zeros [K / G, N] and scales [K / G, N] (fp16), in the checkpoint's [in, out] orientation."""
    n, k = w.shape
    size = k if group == -1 else group
    wg = w.double().reshape(n, k // size, size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scale.double()
    zero = (-torch.round(lo / s)).clamp(0, 15)
    codes = (torch.round(wg / s[..., None]) + zero[..., None]).clamp(0, 15)
    return codes.reshape(n, k).T.long(), zero.T.long(), scale.T.contiguous()


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [R, C] -> int32 words [R, C / 8]: word c holds column 8c + AWQ_ORDER[i] at bits 4i."""
    r, c = values.shape
    v = values.numpy().astype(np.uint32).reshape(r, c // 8, 8)
    words = np.zeros((r, c // 8), dtype=np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        words |= v[:, :, col] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """The inverse of awq_pack, in int64."""
    w = torch.from_numpy(words.numpy().view(np.uint32).astype(np.int64))
    out = torch.empty(w.shape[0], w.shape[1], 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = (w >> (4 * i)) & 0xF
    return out.reshape(w.shape[0], -1)


def awq_dequantize(parts: dict, group: int) -> torch.Tensor:
    """The weight [N, K] (float64) an AWQ GEMM layer stands for: (code - zero) * scale, read from its words."""
    codes, zeros = awq_unpack(parts["qweight"]), awq_unpack(parts["qzeros"])       # [K, N], [K / G, N]
    size = codes.shape[0] if group == -1 else group
    zeros = zeros.repeat_interleave(size, dim=0)
    scales = parts["scales"].double().repeat_interleave(size, dim=0)
    return ((codes - zeros).double() * scales).T.contiguous()


def awq_layer(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    codes, zeros, scales = awq_quantize(w, group)
    parts = {"qweight": awq_pack(codes), "qzeros": awq_pack(zeros), "scales": scales}
    dequant = awq_dequantize(parts, group)
    size = codes.shape[0] if group == -1 else group
    direct = (codes - zeros.repeat_interleave(size, 0)).double() * scales.double().repeat_interleave(size, 0)
    assert torch.equal(dequant, direct.T)            # the packer and its reader agree
    return parts, dequant


def awq_config(group: int, **over) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None, **over}


def write_awq_folder(src: str, model, out_dir: str, group: int, not_convert: tuple[str, ...] = (), **over):
    """The model's folder with its GEMM layers as an AWQ GEMM checkpoint (those named in `not_convert` stay
    dense); returns the transformers model with each quantized weight replaced by its dequantized value."""
    shutil.copytree(src, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "config.json"))
    reference = copy.deepcopy(model)
    tensors = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            base = name[:-len(".weight")]
            if (name.endswith(".weight") and base.rsplit(".", 1)[-1] in QUANTIZED
                    and not any(m in base for m in not_convert)):
                parts, dequant = awq_layer(t, group)
                tensors.update({f"{base}.{p}": v for p, v in parts.items()})
                reference.get_submodule(base).weight.copy_(dequant.float())
            else:
                tensors[name] = t.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = awq_config(group, modules_to_not_convert=list(not_convert) or None, **over)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A Llama (GQA) and a Qwen2 (q/k/v bias, tied embeddings) wide enough for groups of 128 on each of 2 ranks."""
    root = tmp_path_factory.mktemp("awq_src")
    out = {}
    for seed, variant in enumerate(("llama_gqa_llama3", "qwen2_bias_tied")):
        d = str(root / variant)
        out[variant] = (d, build_tiny_model(d, variant, seed=50 + seed, hidden_size=256, intermediate_size=512,
                                            weight_scale=0.05))
    return out


# ---- units ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [-1, 32, 64, 128])
def test_repack_dequantizes_bit_exactly(group):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group + 7), dtype=torch.float64) * 0.1
    parts, want = awq_layer(w, group)
    assert (parts["qweight"] < 0).any()                  # words with the top nibble set (sign bit) are covered
    got = awq.repack("layer", parts, awq.AwqConfig(group))
    assert got["qweight"].dtype == torch.uint8 and got["zeros"].dtype == torch.uint8
    assert torch.equal(dequantize(got["qweight"], got["scales"], got["zeros"], "uint4", group), want.float())


@pytest.mark.parametrize("over,field", [
    ({"version": "gemv"}, "version"), ({"version": "GEMV_fast"}, "version"), ({"version": "marlin"}, "version"),
    ({"version": "exllama"}, "version"), ({"bits": 8}, "bits"), ({"bits": None, "w_bit": 3}, "w_bit"),
    ({"zero_point": False}, "zero_point"), ({"group_size": 48}, "group_size"),
    ({"backend": "llm-awq"}, "backend"), ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_unreadable_configs_are_refused_naming_the_field(over, field):
    qc = {k: v for k, v in awq_config(128, **over).items() if v is not None or k == "modules_to_not_convert"}
    with pytest.raises(QuantConfigError, match=f"quantization_config.{field} "):
        awq.AwqConfig.from_hf(qc)


def test_autoawq_field_names_are_read():
    cfg = awq.AwqConfig.from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                 "version": "GEMM"})
    assert cfg.group_size == 64 and cfg.bits == 4 and cfg.not_converted == ()


def test_bad_layers_are_refused_naming_the_layer():
    parts, _ = awq_layer(torch.randn(16, 128, dtype=torch.float64), 64)
    with pytest.raises(QuantConfigError, match="layer x lacks qzeros"):
        awq.repack("x", {"qweight": parts["qweight"], "scales": parts["scales"]}, awq.AwqConfig(64))
    with pytest.raises(QuantConfigError, match="layer x: scales"):
        awq.repack("x", parts, awq.AwqConfig(32))
    with pytest.raises(QuantConfigError, match="layer x: qweight is torch.int64"):
        awq.repack("x", {**parts, "qweight": parts["qweight"].long()}, awq.AwqConfig(64))


def test_checkpoint_config_refusals_name_the_field(models, tmp_path):
    src, model = models["llama_gqa_llama3"]
    for over, field in (({"version": "gemv"}, "version"), ({"bits": 8}, "bits"), ({"zero_point": False},
                                                                                  "zero_point")):
        folder = str(tmp_path / field)
        write_awq_folder(src, model, folder, 64, **over)
        with pytest.raises(ModelSerializerException, match=f"quantization_config.{field} "):
            HuggingFaceModel(folder, "bad")


# ---- end to end ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,group", [("llama_gqa_llama3", 64), ("llama_gqa_llama3", 128),
                                           ("qwen2_bias_tied", 128), ("qwen2_bias_tied", 32)])
def test_awq_checkpoint_serves_like_its_dequantized_weights(models, tmp_path, variant, group):
    src, model = models[variant]
    folder = str(tmp_path / "awq")
    reference = write_awq_folder(src, model, folder, group)
    name = f"awq_{variant}_{group}"
    loader = HuggingFaceModel(folder, name, user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    engine = start_engine(loader, name, max_batch=4, max_length=256)
    try:
        info = json.loads(engine.get_model_info(name))["quantization"]
        assert info["weight_format"] == "uint4" and info["group_size"] == group and info["quantized_weights"] == 14
        for seed, n in ((1, 5), (2, 70)):
            prompt = random_prompt(n, seed=seed)
            assert_same_tokens(greedy(engine, name, prompt, 24), hf_greedy(reference, prompt, 24), f"{name} {n}")
    finally:
        engine.release_model(name)


def test_modules_to_not_convert_stay_dense(models, tmp_path):
    src, model = models["llama_gqa_llama3"]
    folder = str(tmp_path / "awq")
    reference = write_awq_folder(src, model, folder, 64, not_convert=("down_proj",))
    loader = HuggingFaceModel(folder, "awq_dense", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    engine = start_engine(loader, "awq_dense", max_batch=4, max_length=256)
    try:
        assert json.loads(engine.get_model_info("awq_dense"))["quantization"]["quantized_weights"] == 12
        prompt = random_prompt(40, seed=3)
        assert_same_tokens(greedy(engine, "awq_dense", prompt, 24), hf_greedy(reference, prompt, 24))
    finally:
        engine.release_model("awq_dense")


def test_unservable_modules_to_not_convert_and_requantizing_are_refused(models, tmp_path):
    src, model = models["llama_gqa_llama3"]
    write_awq_folder(src, model, str(tmp_path / "q"), 64, not_convert=("q_proj",))   # fused with k/v, quantized
    with pytest.raises(ModelSerializerException, match="modules_to_not_convert"):
        HuggingFaceModel(str(tmp_path / "q"), "q").load_model()
    write_awq_folder(src, model, str(tmp_path / "ok"), 64)
    loader = HuggingFaceModel(str(tmp_path / "ok"), "ok", user_set_data_type="float32").load_model()
    with pytest.raises(ModelSerializerException, match=r"already quantized \(AWQ\)"):
        loader.serialize(None, model_output_dir=str(tmp_path / "out"), enable_quant=True)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("variant,group", [("llama_gqa_llama3", 128), ("qwen2_bias_tied", 64)])
def test_pool_serves_awq_checkpoint_like_its_dequantized_weights(pool, models, tmp_path, variant, group):
    """2 ranks: o_proj / down_proj split their codes, scales and zero points by input feature (128 / 256 each,
    whole groups); q/k/v/gate/up by output feature."""
    client, _ = pool
    src, model = models[variant]
    folder = str(tmp_path / "awq")
    reference = write_awq_folder(src, model, folder, group)
    name = f"pool_awq_{group}"
    loader = HuggingFaceModel(folder, name, user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    with installed_on_pool(client, loader, name):
        for seed, n in ((4, 33), (5, 7)):
            prompt = random_prompt(n, seed=seed)
            assert_same_tokens(greedy(client, name, prompt, 20), hf_greedy(reference, prompt, 20), f"{name} {n}")
