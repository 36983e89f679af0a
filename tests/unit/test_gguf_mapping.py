"""GGUF blocks onto our formats, checked against the gguf package's own dequantize: Q8_0 / Q4_0 / Q4_1 map bit for
bit (torch.equal on fp32) onto int8 / int4 / uint4_min groups of 32; K-quants are requantized within our formats'
rounding bounds; llama.cpp's q/k row permutation is undone (checked against transformers' own reverse
permutation); the per-weight formats of a scheme travel through its JSON and are enforced on fused projections
and on tensor-parallel splits that would cut a group."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_writer import permute, random_blocks

from allspark_server.layers.sharding import TPLayout
from allspark_server.loader import gguf_tensors as gt
from allspark_server.loader.gguf_names import targets, unpermute
from allspark_server.loader.weights import quantize_layers
from allspark_server.models.args import args_from_hf_config
from allspark_server.quant.formats import dequantize
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

EXACT = [(T.Q8_0, "int8"), (T.Q4_0, "int4"), (T.Q4_1, "uint4_min")]


def ours(parts: dict, fmt: str) -> torch.Tensor:
    return dequantize(parts["qweight"], parts["scales"], parts.get("mins"), fmt, 32)


def weights(seed: int, n: int = 24, k: int = 256) -> np.ndarray:
    """Rows of different character: gaussian, a large outlier per row, all-positive, constant and zero groups."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(1e-3, 10, size=(n, 1)).astype(np.float32)
    w[1, rng.integers(0, k)] = 1e3
    w[2] = np.abs(w[2]) + 0.5
    w[3, :32] = 0.25
    w[4, 32:64] = 0.0
    w[5] = -np.abs(w[5])
    return w


@pytest.mark.parametrize("qtype,fmt", EXACT, ids=[t.name for t, _ in EXACT])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_blocks_dequantize_bit_for_bit_like_gguf(qtype, fmt, seed):
    raw = gguf_quantize(weights(seed), qtype)
    parts = gt.exact_tensors(raw, qtype)
    assert gt.exact_format(qtype) == fmt
    assert parts["qweight"].shape == ((24, 256) if fmt == "int8" else (24, 128))
    assert parts["scales"].dtype == torch.float16 and parts["scales"].shape == (24, 8)
    assert ("mins" in parts) == (fmt == "uint4_min")
    assert torch.equal(ours(parts, fmt), torch.from_numpy(gguf_dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype,fmt", EXACT, ids=[t.name for t, _ in EXACT])
def test_exact_mapping_holds_for_every_code_and_sign_of_scale(qtype, fmt):
    """Raw blocks of random bytes (every code, Q8_0's -128 included, which gguf's quantizer never writes) with
    finite scales and mins of both signs: still bit for bit."""
    rng = np.random.default_rng(7)
    block = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}[qtype]
    raw = rng.integers(0, 256, size=(16, 8, block), dtype=np.uint8)
    halves = rng.uniform(-4, 4, size=(16, 8, 2)).astype(np.float16)
    raw[..., 0:2] = halves[..., :1].view(np.uint8)
    if qtype == T.Q4_1:
        raw[..., 2:4] = halves[..., 1:].view(np.uint8)
    raw = raw.reshape(16, 8 * block)
    assert torch.equal(ours(gt.exact_tensors(raw, qtype), fmt), torch.from_numpy(gguf_dequantize(raw, qtype)))


KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", KQUANTS, ids=[t.name for t in KQUANTS])
@pytest.mark.parametrize("fmt", ["int8", "uint4_min", "int4"])
def test_k_quants_requantize_within_our_rounding(qtype, fmt):
    """K-quant blocks (random codes, sane super-block scales) dequantized by gguf, requantized to `fmt` g32:
    each weight within half a step of its group, but for the clamped end of a range (symmetric: -m where m is
    the group's value of largest magnitude, one step plus 128 times the fp16 rounding of the scale, at most 2^-11
    of it), and the reported relative error is the float64 one."""
    raw = random_blocks((32, 512), qtype, seed=3)
    ref = torch.from_numpy(gguf_dequantize(raw, qtype))
    parts, err = gt.requantize(ref, fmt)
    back = ours(parts, fmt).double()
    step = parts["scales"].double().abs().repeat_interleave(32, dim=1)
    diff = (back - ref.double()).abs()
    if fmt != "uint4_min":
        assert torch.all(diff <= step * (1 + 128 * 2.0 ** -11) + 1e-7)
    else:
        # half a step, but where a value falls outside the stored range: the fp16 rounding of the min (and of
        # the 15 steps up to the max), at most 2^-11 of them
        low = parts["mins"].double().abs().repeat_interleave(32, dim=1)
        assert torch.all(diff <= step * 0.5 + 2.0 ** -11 * (low + 15 * step) + 1e-7)
    assert err == pytest.approx(float((back - ref.double()).norm() / ref.double().norm()), rel=1e-9)
    assert err < {"int8": 0.01, "uint4_min": 0.1, "int4": 0.2}[fmt]


def test_default_requant_formats_and_the_users_choice():
    assert [gt.requant_format(t, None) for t in (T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K, T.IQ4_XS)] == [
        "int8", "int8", "uint4_min", "uint4_min", "uint4_min", "uint4_min"]
    assert gt.requant_format(T.Q4_K, "int8") == "int8"
    assert gt.requant_format(T.Q4_K, {"Q4_K": "uint4"}) == "uint4"
    assert gt.requant_format(T.Q6_K, {"Q4_K": "uint4"}) == "int8"
    with pytest.raises(ValueError, match="'int3' is not one of our formats"):
        gt.requant_format(T.Q4_K, "int3")


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2), (9, 3)])
def test_unpermute_undoes_llama_cpp_permutation_as_transformers_does(heads, kv):
    """convert_hf_to_gguf's permute then ours gives the HF rows back; transformers' GGUF loader (an independent
    implementation) agrees on the file's rows."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    head_dim, hidden = 16, 48
    args = args_from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": hidden,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
                                "num_key_value_heads": kv, "head_dim": head_dim}, qkv_bias_always=False)
    proc = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv})
    rng = np.random.default_rng(0)
    for name, n_rows, n_kv in (("blk.0.attn_q.weight", heads, heads), ("blk.0.attn_k.weight", kv, kv)):
        hf = rng.standard_normal((n_rows * head_dim, hidden)).astype(np.float32)
        stored = permute(hf, heads, n_kv)
        assert not np.array_equal(stored, hf)
        assert torch.equal(unpermute(torch.from_numpy(stored), args), torch.from_numpy(hf))
        assert np.array_equal(proc.process(stored, name).weights, hf)


def test_tensor_names():
    assert targets("blk.3.ffn_norm.weight", "llama", 0)[0].name == "model.layers.3.post_attention_layernorm.weight"
    assert targets("blk.3.ffn_norm.weight", "gemma2", 0)[0].name == "model.layers.3.pre_feedforward_layernorm.weight"
    assert targets("blk.0.attn_q.bias", "qwen2", 0)[0].name == "model.layers.0.self_attn.q_proj.bias"
    assert [t.name for t in targets("blk.1.ffn_up_exps.weight", "qwen3moe", 2)] == [
        "model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"]
    assert targets("rope_freqs.weight", "llama", 0) == []
    assert targets("blk.0.ssm_conv1d.weight", "llama", 0) is None


def meta_llama(intermediate: int, world_size: int = 1):
    from allspark_server.collective.comm import LocalComm
    from allspark_server.models.decoder import DecoderForCausalLM
    args = args_from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                "intermediate_size": intermediate, "num_hidden_layers": 1,
                                "num_attention_heads": 4, "num_key_value_heads": 2}, qkv_bias_always=False)
    tp = TPLayout.for_model(args, 0, world_size)
    with torch.device("meta"):
        return DecoderForCausalLM(args, tp, LocalComm(), torch.float32, max_positions=1)


def gguf_like_scheme(formats: dict[str, str]) -> QuantScheme:
    return QuantScheme("int8", 32, groups={n: 32 for n in formats}, formats=formats)


ATTN = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
MLP = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def test_per_weight_formats_build_each_layer_and_travel_in_the_json():
    formats = {**{n: "int8" for n in ATTN}, **{n: "int4" for n in MLP}}
    scheme = QuantScheme.from_json(gguf_like_scheme(formats).to_json())
    assert scheme.formats == formats and scheme.format_for(MLP[0]) == "int4"
    assert scheme.describe()["weight_formats"] == {"int8": 4, "int4": 3}
    model = meta_llama(128)
    quantize_layers(model, scheme)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant[0] == "int8" and layer.mlp.down_proj.quant[0] == "int4"
    assert layer.mlp.down_proj.qweight.shape == (64, 64) and layer.self_attn.o_proj.qweight.shape == (64, 64)
    legacy = QuantScheme.from_json(QuantScheme("uint4", 32, groups={n: 32 for n in ATTN}).to_json())
    assert legacy.formats == {} and legacy.format_for(ATTN[0]) == "uint4"


def test_fused_parts_of_different_formats_are_refused():
    formats = {**{n: "int8" for n in ATTN}, **{n: "int4" for n in MLP}, ATTN[1]: "int4"}
    with pytest.raises(QuantConfigError, match="fused into one projection.*formats \\['int8', 'int4', 'int8'\\]"):
        quantize_layers(meta_llama(128), gguf_like_scheme(formats))


def test_a_tp_split_that_cuts_a_group_of_32_is_refused():
    """intermediate 96 on 2 ranks: down_proj's 48 input features per rank would cut a GGUF block; 128 splits
    into 64 (two whole blocks)."""
    formats = {n: "int8" for n in ATTN + MLP}
    with pytest.raises(QuantConfigError, match="group_size 32 does not divide its 48 input features.*straddle"):
        quantize_layers(meta_llama(96, world_size=2), gguf_like_scheme(formats), world_size=2)
    quantize_layers(meta_llama(128, world_size=2), gguf_like_scheme(formats), world_size=2)
