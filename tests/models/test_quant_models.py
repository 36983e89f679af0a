"""InstantQuant end to end: serialize a tiny model with quantized weights, serve it through the Engine and a
2-rank pool, and compare with transformers running the same model whose weights were replaced by the stored
codes dequantized *here* (numpy, from the layout in quant/formats.py); bad configs are refused whole."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import greedy, hf_greedy, random_prompt, start_engine
from safetensors import safe_open
from test_tensor_parallel import mpirun_env, tp_logits

from allspark_client import AsException
from allspark_server import Engine, HuggingFaceModel
from allspark_server.loader.hf_model import ModelSerializerException

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def serialize_quantized(hf_dir: str, name: str, out_dir: str, config: dict, dtype: str = "float32"):
    loader = HuggingFaceModel(hf_dir, name, user_set_data_type=dtype)
    loader.load_model().serialize(None, model_output_dir=out_dir, enable_quant=True,
                                  customized_quant_config=config).free_model()
    return loader


def dequantize_here(f, base: str, fmt: str, group: int) -> torch.Tensor:
    """The weight `base` stands for, from its stored tensors: (code - zero) * scale, written independently."""
    q = f.get_tensor(base + ".qweight").numpy()
    if fmt == "fp8_e4m3":      # OCP E4M3 bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits
        e, mant = (q >> 3) & 15, (q & 7).astype(np.float64)
        codes = np.where(e == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * 2.0 ** (e.astype(np.float64) - 7))
        codes = np.where(q >= 128, -codes, codes)
    elif fmt in ("int4", "uint4"):
        n, half = q.shape
        blocks = q.reshape(n, half // 16, 16)
        codes = np.concatenate([blocks & 0xF, blocks >> 4], axis=2).reshape(n, 2 * half).astype(np.float64)
        if fmt == "int4":
            codes -= 8
    else:
        codes = q.astype(np.float64)
    n, k = codes.shape
    size = k if group == -1 else group
    scales = f.get_tensor(base + ".scales").float().numpy().astype(np.float64)
    zeros = (f.get_tensor(base + ".zeros").numpy().astype(np.float64) if fmt.startswith("u")
             else np.zeros_like(scales))
    w = (codes.reshape(n, k // size, size) - zeros[..., None]) * scales[..., None]
    return torch.from_numpy(w.reshape(n, k)).float()


def hf_with_stored_weights(hf_model, loader, fmt: str, group: int, lm_head: bool = False):
    """A copy of the transformers model whose GEMM weights (and LM head) are the quantized file's, dequantized."""
    model = copy.deepcopy(hf_model)
    with safe_open(loader.weights_path, framework="pt") as f, torch.no_grad():
        stored = set(f.keys())
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in QUANTIZED:
                assert name + ".qweight" in stored and name + ".weight" not in stored
                module.weight.copy_(dequantize_here(f, name, fmt, group))
        if lm_head:       # its own parameter (a tied head is untied: the embedding stays unquantized)
            model.lm_head.weight = torch.nn.Parameter(dequantize_here(f, "lm_head", fmt, group))
    return model


CASES = [("int8", -1), ("uint8", 32), ("int4", 64), ("uint4", 32), ("uint4", -1)]


@pytest.mark.parametrize("fmt,group", CASES)
def test_engine_serves_quantized_weights_like_transformers(llama, tmp_path, fmt, group):
    name = f"q_{fmt}_{group}"
    loader = serialize_quantized(llama.hf_dir, name, str(tmp_path), {"weight_format": fmt, "group_size": group})
    reference = hf_with_stored_weights(llama.model, loader, fmt, group)
    engine = start_engine(loader, name, max_batch=4, max_length=512)
    try:
        info = json.loads(engine.get_model_info(name))
        assert info["quantization"]["weight_format"] == fmt and info["quantization"]["group_size"] == group
        assert info["quantization"]["quantized_weights"] == 2 * 7
        for seed, n in ((1, 5), (2, 40), (3, 130)):      # decode steps and chunked prefill
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, name, prompt, 24) == hf_greedy(reference, prompt, 24), (fmt, group, n)
    finally:
        engine.release_model(name)


def round_inputs_to_int8(model):
    """Forward pre-hooks on the quantized projections: each input row rounded to int8 levels, q = round(x * 127 /
    absmax) (fp32, half to even) times absmax / 127: activate_quant's activations, written here."""
    def hook(_, args):
        x = args[0]
        amax = x.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(127.0, dtype=x.dtype) / amax, torch.zeros_like(amax))
        return (torch.round(x * inv) * (amax / 127.0),) + tuple(args[1:])
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED:
            module.register_forward_pre_hook(hook)
    return model


def round_inputs_to_fp8(model):
    """Forward pre-hooks on the quantized projections: each input row rounded to e4m3 (torch's cast, to nearest even)
    after division by the power of two 2^ceil(log2(max|x| / 448)), then multiplied back: activate_quant's
    activations with fp8 weights, written here."""
    def hook(_, args):
        x = args[0]
        amax = x.abs().amax(-1, keepdim=True).double()
        scale = torch.where(amax > 0, 2.0 ** torch.ceil(torch.log2(amax / 448)), torch.ones_like(amax)).to(x.dtype)
        return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale,) + tuple(args[1:])
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED:
            module.register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("fmt,group", [("int8", -1), ("int4", 32)])
def test_activate_quant_serves_like_transformers_with_int8_activations(llama, tmp_path, fmt, group):
    """compute_method activate_quant (A8W8; A8W4 with 4-bit codes, whose batch-1 decode has its own AVX2 kernel):
    the stored codes are weight-only's; every quantized projection meets its input rounded to int8 per token, in
    decode steps and in (chunked) prefill alike."""
    cfg = {"weight_format": fmt, "group_size": group, "compute_method": "activate_quant"}
    loader = serialize_quantized(llama.hf_dir, "q_a8", str(tmp_path), cfg)
    reference = round_inputs_to_int8(hf_with_stored_weights(llama.model, loader, fmt, group))
    weight_only = hf_with_stored_weights(llama.model, loader, fmt, group)
    engine = start_engine(loader, "q_a8", max_batch=4, max_length=512)
    try:
        assert json.loads(engine.get_model_info("q_a8"))["quantization"]["compute_method"] == "activate_quant"
        for seed, n in ((1, 5), (2, 40), (3, 130)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, "q_a8", prompt, 24) == hf_greedy(reference, prompt, 24), n
        with torch.no_grad():   # the int8 rounding is really applied: the logits move off weight-only's
            ids = torch.tensor([random_prompt(40, seed=2)])
            gap = (reference(ids).logits - weight_only(ids).logits).abs().max().item()
        assert gap > 1e-4, gap
    finally:
        engine.release_model("q_a8")


@pytest.mark.parametrize("variant", ["llama_gqa_llama3", "qwen2_bias_tied"])
def test_quantize_lm_head_option(tiny_models, tmp_path, variant):
    """quantize_lm_head (off by default): the LM head gets codes too; a tied head its own, from the embedding."""
    tm = tiny_models[variant]
    cfg = {"weight_format": "int8", "group_size": 64, "quantize_lm_head": True}
    loader = serialize_quantized(tm.hf_dir, "q_head", str(tmp_path), cfg)
    with safe_open(loader.weights_path, framework="pt") as f:
        assert {"lm_head.qweight", "model.embed_tokens.weight"} <= set(f.keys()) and "lm_head.weight" not in f.keys()
    reference = hf_with_stored_weights(tm.model, loader, "int8", 64, lm_head=True)
    engine = start_engine(loader, "q_head", max_batch=4, max_length=512)
    try:
        assert json.loads(engine.get_model_info("q_head"))["quantization"]["quantize_lm_head"] is True
        for seed, n in ((1, 5), (2, 40)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, "q_head", prompt, 16) == hf_greedy(reference, prompt, 16), (variant, n)
    finally:
        engine.release_model("q_head")


def test_quantized_file_is_smaller_and_keeps_other_tensors_dense(llama, tmp_path):
    dense = HuggingFaceModel(llama.hf_dir, "d", user_set_data_type="bfloat16").load_model()
    dense.serialize(None, model_output_dir=str(tmp_path))
    q = serialize_quantized(llama.hf_dir, "q", str(tmp_path), {"weight_format": "uint4", "group_size": 32},
                            dtype="bfloat16")
    with safe_open(q.weights_path, framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (64, 64)    # [N, K/2]
        assert f.get_tensor("model.layers.0.mlp.down_proj.scales").shape == (64, 4)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.norm.weight" in keys and "lm_head.weight" in keys
    assert os.path.getsize(q.weights_path) < os.path.getsize(dense.weights_path)


def test_bf16_quantized_model_generates_like_its_fp32_reference(llama, tmp_path):
    """bf16 activations over int8 weights: the greedy tokens follow the fp32 dequantized reference on most
    positions (bf16 rounding may flip a near-tie of the random model, so the first 8 must agree)."""
    loader = serialize_quantized(llama.hf_dir, "q_bf16", str(tmp_path), {"weight_format": "int8"}, "bfloat16")
    engine = start_engine(loader, "q_bf16", max_batch=4, max_length=512)
    try:
        prompt = random_prompt(20, seed=5)
        reference = hf_with_stored_weights(llama.model, loader, "int8", -1)
        assert greedy(engine, "q_bf16", prompt, 8) == hf_greedy(reference.to(torch.bfloat16), prompt, 8)
    finally:
        engine.release_model("q_bf16")


@pytest.mark.parametrize("config,match", [
    ({"weight_format": "int3"}, "weight_format 'int3'"),
    ({"weight_format": "int8", "group_size": 48}, "group_size 48"),
    ({"weight_format": "uint4", "group_size": 256}, "group_size 256 does not divide"),
    ({"weight_format": "int8", "group_settings": {r"\.k_proj\.": 32}}, "fused into one projection"),
    ({"weight_format": "int8", "compute_method": "fp8_a8w8"}, "compute_method 'fp8_a8w8'"),
    ({"weight_format": "fp8_e4m3", "compute_method": "activate_quant", "group_size": 128},
     "activate_quant with fp8_e4m3 weights needs per-channel scales"),
    ({"weight_format": "fp8_e4m3", "compute_method": "activate_quant", "activate_format": "int8"},
     "activate_format 'int8' is not supported with fp8_e4m3 weights"),
    ({"weight_format": "int8", "bits": 4}, "unknown keys"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
])
def test_bad_quant_configs_are_refused_and_write_nothing(llama, tmp_path, config, match):
    loader = HuggingFaceModel(llama.hf_dir, "bad").load_model()
    with pytest.raises(ModelSerializerException, match=match):
        loader.serialize(None, model_output_dir=str(tmp_path), enable_quant=True, customized_quant_config=config)
    assert os.listdir(tmp_path) == []


def test_fp8_weights_are_refused_on_a_cpu_rank_and_the_engine_keeps_serving(llama, tmp_path):
    """fp8_e4m3 serializes anywhere (the codes are data) but is served on GPUs of compute capability 8.9+ only:
    a CPU rank refuses it at install, naming the format and why, and the engine serves the next model."""
    loader = serialize_quantized(llama.hf_dir, "q_fp8", str(tmp_path), {"weight_format": "fp8_e4m3"})
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("q_fp8", "cpu", [0], max_batch=2).max_length(128)
           .kv_cache_span_size(16).build())
    with pytest.raises(AsException, match="fp8_e4m3 weights cannot be served here: this rank runs on a CPU"):
        engine.install_model(cfg)
    dense = HuggingFaceModel(llama.hf_dir, "after_fp8")
    dense.load_model().serialize(None, model_output_dir=str(tmp_path / "dense")).free_model()
    start_engine(dense, "after_fp8", engine=engine, max_batch=2, max_length=128)
    try:
        prompt = random_prompt(6, seed=3)
        assert greedy(engine, "after_fp8", prompt, 6) == hf_greedy(llama.model, prompt, 6)
    finally:
        engine.release_model("after_fp8")


@pytest.mark.parametrize("fmt,group", [("int8", -1), ("uint4", 32)])
def test_tp_logits_of_quantized_shards_equal_single_process(llama, tmp_path, fmt, group):
    """2 ranks, each reading its slice of the codes, scales (split or, per channel, replicated) and zeros."""
    loader = serialize_quantized(llama.hf_dir, "tpq", str(tmp_path), {"weight_format": fmt, "group_size": group})
    result = tp_logits(loader, random_prompt(40, seed=21) + random_prompt(16, seed=22), 40, tmp_path)
    assert result["world_size"] == 2 and result["max_abs_diff"] <= 1e-4 and result["argmax_equal"], result


def test_tp_logits_of_activate_quant_stay_close_to_single_process(llama, tmp_path):
    """activate_quant on 2 ranks: a row-parallel projection (o, down) rounds each rank's half of its input
    row with that half's own int8 scale, so the logits differ from one process's by int8 rounding, not more
    (one process vs transformers with int8 inputs is test_activate_quant_serves_like_transformers...)."""
    cfg = {"weight_format": "int8", "compute_method": "activate_quant"}
    loader = serialize_quantized(llama.hf_dir, "tpa8", str(tmp_path), cfg)
    result = tp_logits(loader, random_prompt(40, seed=21) + random_prompt(16, seed=22), 40, tmp_path)
    print(f"activate_quant 2-rank vs 1-rank: {result}")
    assert result["world_size"] == 2 and result["argmax_equal"], result
    assert 1e-4 < result["max_abs_diff"] <= 0.05, result


def test_pool_serves_quantized_model_like_engine(pool, llama, tmp_path):
    client, _ = pool
    loader = serialize_quantized(llama.hf_dir, "pool_q", str(tmp_path), {"weight_format": "uint4", "group_size": 32})
    cfg = (loader.create_reference_runtime_config_builder("pool_q", "cpu", [0], max_batch=4).max_length(512)
           .kv_cache_span_size(16).build())
    client.install_model(cfg)
    client.start_model("pool_q")
    engine = start_engine(loader, "pool_q", max_batch=4, max_length=512)
    try:
        assert json.loads(client.get_model_info("pool_q"))["quantization"]["weight_format"] == "uint4"
        for seed, n in ((1, 6), (2, 70)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(client, "pool_q", prompt, 24) == greedy(engine, "pool_q", prompt, 24)
    finally:
        engine.release_model("pool_q")
        assert client.stop_model("pool_q") == 0 and client.release_model("pool_q") == 0


def test_pool_refuses_groups_that_straddle_the_split_and_keeps_serving(pool, llama, tmp_path):
    """o_proj has 64 input features: on 2 ranks each holds 32, so groups of 64 would span both ranks."""
    client, _ = pool
    loader = serialize_quantized(llama.hf_dir, "pool_bad", str(tmp_path), {"weight_format": "int8", "group_size": 64})
    cfg = (loader.create_reference_runtime_config_builder("pool_bad", "cpu", [0], max_batch=2).max_length(256)
           .kv_cache_span_size(16).build())
    with pytest.raises(AsException, match="group_size 64 does not divide its 32 input features.*straddle"):
        client.install_model(cfg)
    with pytest.raises(AsException):
        client.get_model_info("pool_bad")          # nothing half-installed
    assert greedy(client, "llama", random_prompt(5, seed=1), 4) == hf_greedy(llama.model, random_prompt(5, seed=1), 4)


def test_engine_runs_the_torch_reference_path_without_native(llama, tmp_path):
    """ALLSPARK_NO_NATIVE=1: the same quantized file through the pure-PyTorch path, same tokens as native."""
    loader = serialize_quantized(llama.hf_dir, "q_ref", str(tmp_path), {"weight_format": "int4", "group_size": 32})
    prompt = random_prompt(30, seed=9)
    code = ("import json, sys; sys.path.insert(0, %r); from helpers import greedy, start_engine; "
            "from allspark_server import HuggingFaceModel; "
            "l = HuggingFaceModel(%r, 'q_ref'); l.graph_path, l.weights_path = %r, %r; "
            "e = start_engine(l, 'q_ref', max_batch=2, max_length=256); "
            "print(json.dumps(greedy(e, 'q_ref', %r, 12)))") % (TESTS, llama.hf_dir, loader.graph_path,
                                                                 loader.weights_path, prompt)
    env = dict(mpirun_env(), ALLSPARK_NO_NATIVE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = start_engine(loader, "q_ref", max_batch=2, max_length=256)
    try:
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == greedy(engine, "q_ref", prompt, 12)
    finally:
        engine.release_model("q_ref")


# ---- GPTQ checkpoints ------------------------------------------------------------------------------------------

def gptq_pack_layer(w: torch.Tensor, bits: int, group: int, sym: bool) -> tuple[dict, torch.Tensor]:
    """Quantize w [N, K] the way GPTQ stores it (its published "classic" format: int32 words packed along K for
    qweight and along N for qzeros, lowest bits first; the stored zero point is zero - 1) and return the
    tensors and the weight they stand for. Written here from the format's description, not from allspark."""
    n, k = w.shape
    size = k if group == -1 else group
    top = 2 ** bits - 1
    wg = w.double().reshape(n, k // size, size)
    if sym:
        scale = wg.abs().amax(-1) * 2 / top
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale).clamp(1, top)          # >= 1: the stored zero - 1 stays non-negative
    scale = scale.half().double()
    codes = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, top).to(torch.int64)
    dequant = ((codes - zero[..., None]) * scale[..., None]).reshape(n, k).float()
    per = 32 // bits
    codes_kn = codes.reshape(n, k).T.numpy().astype(np.uint64)              # [K, N]
    qweight = np.zeros((k // per, n), dtype=np.uint64)
    for j in range(per):
        qweight |= codes_kn[j::per] << np.uint64(j * bits)
    stored_zero = (zero.to(torch.int64) - 1).T.numpy().astype(np.uint64)      # [G, N]
    qzeros = np.zeros((k // size, n // per), dtype=np.uint64)
    for j in range(per):
        qzeros |= stored_zero[:, j::per] << np.uint64(j * bits)
    as_i32 = lambda a: torch.from_numpy(a.astype(np.uint32).view(np.int32))  # noqa: E731
    return {"qweight": as_i32(qweight), "qzeros": as_i32(qzeros), "scales": scale.T.half().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // size}, dequant


def save_quantized_folder(tm, out_dir: str, tensors: dict, quantization_config: dict) -> None:
    """The checkpoint `tensors` (a tied LM head dropped) and the tiny model's config.json with `quantization_config`
    into `out_dir`."""
    from safetensors.torch import save_file
    if tm.model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(tm.hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)


def update_quantization_config(folder: str, **change) -> None:
    """The folder's config.json with `change` merged into its quantization_config."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(change)
    with open(path, "w") as f:
        json.dump(cfg, f)


def write_gptq_folder(tm, out_dir, bits: int, group: int, sym: bool, desc_act: bool = False):
    """The tiny model's folder with its GEMM layers as a GPTQ checkpoint; returns the dequantized HF model."""
    import shutil
    shutil.copytree(tm.hf_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.json"))
    for f in os.listdir(tm.hf_dir):
        if f.endswith(".json") and f != "config.json":
            shutil.copy(os.path.join(tm.hf_dir, f), out_dir)
    reference = copy.deepcopy(tm.model)
    tensors = {}
    with torch.no_grad():
        for name, t in tm.model.state_dict().items():
            base = name[:-len(".weight")]
            if name.endswith(".weight") and base.rsplit(".", 1)[-1] in QUANTIZED:
                parts, dequant = gptq_pack_layer(t, bits, group, sym)
                tensors.update({f"{base}.{p}": v for p, v in parts.items()})
                reference.get_submodule(base).weight.copy_(dequant)
            else:
                tensors[name] = t.contiguous()
    save_quantized_folder(tm, out_dir, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                                 "sym": sym, "desc_act": desc_act, "checkpoint_format": "gptq"})
    return reference


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, -1, False), (8, 64, False)])
def test_gptq_checkpoint_serves_like_its_dequantized_weights(llama, tmp_path, bits, group, sym):
    folder = str(tmp_path / "gptq")
    reference = write_gptq_folder(llama, folder, bits, group, sym)
    name = f"gptq{bits}_{group}"
    loader = HuggingFaceModel(folder, name, user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    engine = start_engine(loader, name, max_batch=4, max_length=512)
    try:
        info = json.loads(engine.get_model_info(name))["quantization"]
        assert info["weight_format"] == ("uint4" if bits == 4 else "uint8") and info["group_size"] == group
        for seed, n in ((1, 5), (2, 70)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, name, prompt, 24) == hf_greedy(reference, prompt, 24), (bits, group, n)
    finally:
        engine.release_model(name)


def test_gptq_desc_act_and_requantizing_are_refused(llama, tmp_path):
    write_gptq_folder(llama, str(tmp_path / "act"), 4, 32, True, desc_act=True)
    with pytest.raises(ModelSerializerException, match="desc_act"):
        HuggingFaceModel(str(tmp_path / "act"), "act")
    write_gptq_folder(llama, str(tmp_path / "ok"), 4, 32, True)
    loader = HuggingFaceModel(str(tmp_path / "ok"), "ok", user_set_data_type="float32").load_model()
    with pytest.raises(ModelSerializerException, match="already quantized"):
        loader.serialize(None, model_output_dir=str(tmp_path / "out"), enable_quant=True)
    assert not os.path.exists(tmp_path / "out")


def test_pool_serves_gptq_checkpoint_like_engine(pool, llama, tmp_path):
    """GPTQ 8-bit, groups of 32: the 2 ranks split o_proj/down_proj's codes, scales and zero points by input
    feature (each rank's 32 or 64 features hold whole groups)."""
    client, _ = pool
    folder = str(tmp_path / "gptq")
    reference = write_gptq_folder(llama, folder, 8, 32, False)
    loader = HuggingFaceModel(folder, "pool_gptq", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    cfg = (loader.create_reference_runtime_config_builder("pool_gptq", "cpu", [0], max_batch=2).max_length(256)
           .kv_cache_span_size(16).build())
    client.install_model(cfg)
    client.start_model("pool_gptq")
    try:
        prompt = random_prompt(33, seed=4)
        assert greedy(client, "pool_gptq", prompt, 20) == hf_greedy(reference, prompt, 20)
    finally:
        assert client.stop_model("pool_gptq") == 0 and client.release_model("pool_gptq") == 0


@pytest.mark.parametrize("fmt,group", [("int8", -1), ("uint4", 32)])
def test_quantized_gemma2_serves_like_transformers(tmp_path, fmt, group):
    """A Gemma 2 layer (sandwich norms, GELU-tanh, soft caps, a sliding window under the longer prompts) with
    quantized weights: greedy equals transformers running the stored codes dequantized here."""
    from allspark_server.loader.tiny_model import build_tiny_model
    src = str(tmp_path / "gemma2")
    model = build_tiny_model(src, "gemma2", seed=41, weight_scale=0.08)
    name = f"g2_{fmt}"
    loader = serialize_quantized(src, name, str(tmp_path / "out"), {"weight_format": fmt, "group_size": group})
    reference = hf_with_stored_weights(model, loader, fmt, group)
    engine = start_engine(loader, name, max_batch=4, max_length=256)
    try:
        for seed, n in ((1, 5), (2, 40)):            # shorter and longer than the window of 16
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, name, prompt, 24) == hf_greedy(reference, prompt, 24), (fmt, group, n)
    finally:
        engine.shutdown()
