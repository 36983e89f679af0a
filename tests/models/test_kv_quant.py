"""Quantized KV spans (kv_cache_mode int8 / uint4): the row format worked by hand, the native cache write
bit-equal to the torch reference, decode attention over quantized spans against a float64 computation
written here, and models served with quantized KV through the Engine and a 2-rank pool."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import greedy, hf_greedy, hf_logits, random_prompt, serialize

from allspark_client import AsCacheMode, AsException, GenerateRequestStatus
from allspark_client.config import ConfigError
from allspark_server.compute import ops
from allspark_server.compute.steps import Attention
from allspark_server.quant import kv as kv_quant
from allspark_server.step.kv_cache import KVCache, bytes_per_span

ISAS = [i for i in (ops.ISA_PORTABLE, ops.ISA_AVX2, ops.ISA_AVX512) if i <= ops.isa_level()]
needs_native = pytest.mark.skipif(ops.native() is None, reason="native kernels not built")


# ---- the row format ------------------------------------------------------------------------------------

def test_int8_row_by_hand():
    # lo = -2, hi = 127/64: scale = (255/64) / 255 = 1/64 exactly, zero = round(2 * 64) - 128 = 0
    codes, params = kv_quant.quantize_rows(torch.tensor([[-2.0, 0.0, 127 / 64, 1 / 64]]), "int8")
    assert codes.dtype == torch.int8 and codes.tolist() == [[-128, 0, 127, 1]]
    assert params.tolist() == [[1 / 64, 0.0]]


def test_uint4_row_by_hand():
    # lo = -1.5, hi = 6: scale = 7.5 / 15 = 0.5, zero = round(3) = 3; codes 0, 3, 9, 15
    codes, params = kv_quant.quantize_rows(torch.tensor([[-1.5, 0.0, 3.0, 6.0]]), "uint4")
    # byte j: element j low nibble, element D/2 + j high nibble
    assert codes.dtype == torch.uint8 and codes.tolist() == [[0 | (9 << 4), 3 | (15 << 4)]]
    assert params.tolist() == [[0.5, 3.0]]
    assert kv_quant.dequantize_rows(codes, params, "uint4").tolist() == [[-1.5, 0.0, 3.0, 6.0]]


def test_fp8_row_by_hand():
    # max |x| = 2: scale = 2 / 448; x / scale = 224 (1.75 * 2^7), -448, 112, 0, 67.2 (rounds to 64: e4m3 keeps 3
    # mantissa bits); OCP E4M3 bytes: sign, exponent (bias 7), mantissa
    codes, params = kv_quant.quantize_rows(torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.3]]), "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    assert codes.view(torch.uint8).tolist() == [[0b0_1110_110, 0b1_1111_110, 0b0_1101_110, 0, 0b0_1101_000]]
    scale = torch.tensor(2 / 448).item()
    assert params.tolist() == [[scale, 0.0]]
    back = kv_quant.dequantize_rows(codes, params, "fp8")
    assert torch.equal(back, torch.tensor([[224.0, -448, 112, 0, 64]]) * params[:, :1])


def test_zero_row_and_one_sided_rows():
    for mode in kv_quant.KV_MODES:
        codes, params = kv_quant.quantize_rows(torch.zeros(1, 8), mode)
        assert kv_quant.dequantize_rows(codes, params, mode).abs().max() == 0
        x = torch.tensor([[0.5, 1.0, 2.0, 4.0], [-4.0, -2.0, -1.0, -0.5]])   # all positive / all negative
        back = kv_quant.dequantize_rows(*kv_quant.quantize_rows(x, mode), mode)
        assert back[0, 3] == 4.0 and back[1, 0] == -4.0                     # the extreme is exact


@pytest.mark.parametrize("mode,levels", [("int8", 255), ("uint4", 15)])
def test_rows_round_trip_within_half_a_step(mode, levels):
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(3)) * 3
    back = kv_quant.dequantize_rows(*kv_quant.quantize_rows(x, mode), mode).double()
    xd = x.double()
    step = (xd.amax(-1, keepdim=True).clamp(min=0) - xd.amin(-1, keepdim=True).clamp(max=0)) / levels
    assert ((back - xd).abs() <= step / 2 * (1 + 1e-5)).all()


def test_span_bytes_and_capacity():
    """Per token and KV head: bf16 2 * 128 bytes; int8 128 + 8 (scale and zero); uint4 64 + 8."""
    dense = bytes_per_span(16, 32, 4, 128, torch.bfloat16)
    assert dense == 2 * 16 * 32 * 4 * 256
    assert bytes_per_span(16, 32, 4, 128, torch.bfloat16, "int8") == 2 * 16 * 32 * 4 * 136
    assert bytes_per_span(16, 32, 4, 128, torch.bfloat16, "uint4") == 2 * 16 * 32 * 4 * 72
    cache = KVCache(2, 3, 16, 2, 64, torch.bfloat16, "uint4")
    layer = cache.layers[1]
    assert layer.mode == "uint4" and layer.k.shape == (3, 16, 2, 32) and layer.v_param.shape == (3, 16, 2, 2)


# ---- kernels ---------------------------------------------------------------------------------------------

def _filled_cache(mode, dtype, num_spans, span, kvh, d, seed):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, num_spans, span, kvh, d, dtype, mode).layers[0]
    n = num_spans * span
    k = (torch.randn(n, kvh, d, generator=g) * 2).to(dtype)
    v = torch.randn(n, kvh, d, generator=g).to(dtype)
    ops.store_kv_reference(k, v, *cache[:2], torch.arange(n), *cache[2:])
    return cache


@needs_native
@pytest.mark.parametrize("mode", kv_quant.NATIVE_KV_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_equals_reference_bit_for_bit(mode, dtype):
    g = torch.Generator().manual_seed(1)
    ref = KVCache(1, 4, 16, 3, 64, dtype, mode).layers[0]
    nat = KVCache(1, 4, 16, 3, 64, dtype, mode).layers[0]
    qkv = (torch.randn(9, 3 * 64 * 3, generator=g) * 4).to(dtype)   # k, v as strided views into a fused output
    k, v = qkv[:, 192:384].view(9, 3, 64), qkv[:, 384:]
    slots = torch.tensor([0, 5, 17, 18, 40, 63, 2, 33, 50])
    ops.store_kv_reference(k, v, ref.k, ref.v, slots, ref.k_param, ref.v_param)
    ops.store_kv(k, v, nat.k, nat.v, slots, nat.k_param, nat.v_param)
    for a, b in zip(ref, nat):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="slot 64 outside"):
        ops.store_kv(k[:1], v[:1], nat.k, nat.v, torch.tensor([64]), nat.k_param, nat.v_param)


def attention_float64(q, cache, spans, ctx, scale):
    """Decode attention over the dequantized rows, in float64, written without the ops module."""
    s, p, kvh = cache.k.shape[:3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        slots = [int(spans[b, t // p]) * p + t % p for t in range(int(ctx[b]))]
        k = kv_quant.dequantize_rows(cache.k.view(s * p, kvh, -1)[slots], cache.k_param.view(s * p, kvh, 2)[slots],
                                     cache.mode).double()            # [n, kvh, D]
        v = kv_quant.dequantize_rows(cache.v.view(s * p, kvh, -1)[slots], cache.v_param.view(s * p, kvh, 2)[slots],
                                     cache.mode).double()
        group = q.shape[1] // kvh
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, 0)
            out[b, h] = w @ v[:, h // group]
    return out


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", kv_quant.NATIVE_KV_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(4, 4, 64), (12, 4, 128), (6, 2, 48), (2, 1, 32)])
def test_native_decode_attention_over_quantized_spans(isa, mode, dtype, heads, kvh, d):
    span = 16
    cache = _filled_cache(mode, dtype, 24, span, kvh, d, seed=heads + d)
    ctx = torch.tensor([1, 15, 16, 17, 100, 300])
    g = torch.Generator().manual_seed(7)
    spans = torch.stack([torch.randperm(24, generator=g) for _ in ctx])[:, :19]     # 19 spans hold 300 tokens
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    ext = ops.native()
    out = ext.decode_attention_quant(q, cache.k, cache.k_param, cache.v, cache.v_param, spans, ctx,
                                     ops.attention_options(d ** -0.5), isa)
    expected = attention_float64(q, cache, spans, ctx, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2    # bf16: one rounding of the output
    assert out.dtype == dtype and torch.allclose(out.double(), expected, atol=tol, rtol=tol)
    # the torch reference the model falls back on agrees too
    ref = ops.decode_attention_reference(q, cache.k, cache.v, spans, ctx, Attention(d ** -0.5), cache.k_param,
                                         cache.v_param)
    assert torch.allclose(ref.double(), expected, atol=tol, rtol=tol)


# ---- models ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp32_loader(llama, tmp_path_factory):
    return serialize(llama.hf_dir, "kvq", str(tmp_path_factory.mktemp("kvq")))


def _start(loader, name, mode, **kw):
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4).max_length(512)
           .kv_cache_span_size(16).kv_cache_mode(mode))
    for k, v in kw.items():
        getattr(cfg, k)(v)
    from allspark_server import Engine
    engine = Engine()
    engine.install_model(cfg.build())
    engine.start_model(name)
    return engine


@pytest.mark.parametrize("mode", [AsCacheMode.AsCacheQuantI8, "int8"])
def test_int8_kv_greedy_tokens_equal_transformers(llama, fp32_loader, mode):
    """int8 KV on the fp32 tiny model: greedy tokens equal transformers' (unquantized) on these prompts,
    through decode steps, a prefill split into chunks and a prefill after cached spans."""
    engine = _start(fp32_loader, "kvq8", mode, max_prefill_length=64)
    try:
        info = json.loads(engine.get_model_info("kvq8"))
        assert info["kv_cache_mode"] == "int8"
        for seed, n in ((1, 5), (2, 40), (3, 130)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, "kvq8", prompt, 24) == hf_greedy(llama.model, prompt, 24), n
    finally:
        engine.release_model("kvq8")
        engine.shutdown()


def assert_logprobs_close_to_transformers(engine, name: str, hf_model) -> None:
    """The logprob of each of 16 greedy tokens after a 60-token prompt is within 0.1 of transformers' for the
    same tokens fed, and >= 75% of the tokens are transformers' argmax (uint4 KV's bound)."""
    prompt = random_prompt(60, seed=4)
    status, handle, queue = engine.start_request(name, {"input_ids": prompt},
                                                 {"top_k": 1, "max_new_tokens": 16, "logprobs": True,
                                                  "top_logprobs": 1, "eos_token_id": []})
    assert status == 0
    engine.sync_request(name, handle)
    out = queue.Get()
    assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished, queue.ErrorMessage()
    tokens = out.ids_from_generate
    logprobs = out.token_logprobs_list
    assert len(tokens) == len(logprobs) == 16
    ref = torch.log_softmax(hf_logits(hf_model, prompt + tokens)[len(prompt) - 1:-1].double(), -1)
    ours = torch.tensor(logprobs, dtype=torch.float64)
    picked = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (ours - picked).abs().max() < 0.1, (ours, picked)
    top1 = (ref.argmax(-1) == torch.tensor(tokens)).float().mean()
    assert top1 >= 0.75


def test_uint4_kv_logit_error_is_small(llama, fp32_loader):
    """uint4 KV: the logits of every generated position stay close to transformers' (same tokens fed)."""
    engine = _start(fp32_loader, "kvq4", AsCacheMode.AsCacheQuantU4)
    try:
        assert_logprobs_close_to_transformers(engine, "kvq4", llama.model)
    finally:
        engine.release_model("kvq4")
        engine.shutdown()


def test_quantized_kv_holds_more_tokens_in_the_same_budget(fp32_loader):
    budget = 4 << 20
    totals = {}
    for mode in ("default", "int8", "uint4"):
        engine = _start(fp32_loader, f"kvcap_{mode}", mode, kv_cache_memory=budget)
        try:
            totals[mode] = engine.get_as_engine_stat(f"kvcap_{mode}").total_token
        finally:
            engine.release_model(f"kvcap_{mode}")
            engine.shutdown()
    # tiny llama: head_dim 16 fp32 -> 64 bytes a row dense, 16 + 8 int8, 8 + 8 uint4
    assert totals["int8"] / totals["default"] == pytest.approx(64 / 24, rel=0.02)
    assert totals["uint4"] / totals["default"] == pytest.approx(64 / 16, rel=0.02)


def test_kv_mode_refused_for_fp16_and_engine_keeps_serving(llama, tmp_path):
    loader = serialize(llama.hf_dir, "kv16", str(tmp_path), dtype="float16")
    from allspark_server import Engine
    engine = Engine()
    try:
        cfg = (loader.create_reference_runtime_config_builder("kv16", "cpu", [0], max_batch=2).max_length(128)
               .kv_cache_mode("int8").build())
        with pytest.raises(AsException, match="kv_cache_mode int8 needs a float32 or bfloat16 model"):
            engine.install_model(cfg)
        with pytest.raises(AsException):
            engine.get_model_info("kv16")                   # nothing half-installed
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="cache_mode"):
        loader.create_reference_runtime_config_builder("kv16", "cpu", [0], max_batch=2).kv_cache_mode("int4").build()


def test_fp8_kv_is_refused_on_a_cpu_rank_and_engine_keeps_serving(llama, fp32_loader):
    from allspark_server import Engine
    engine = Engine()
    try:
        cfg = (fp32_loader.create_reference_runtime_config_builder("kvfp8", "cpu", [0], max_batch=2).max_length(128)
               .kv_cache_mode("fp8").build())
        assert cfg.cache_mode == AsCacheMode.AsCacheQuantFp8
        with pytest.raises(AsException, match="kv_cache_mode fp8 cannot be used here: this rank runs on a CPU"):
            engine.install_model(cfg)
        cfg = (fp32_loader.create_reference_runtime_config_builder("kv16", "cpu", [0], max_batch=2).max_length(128)
               .build())
        engine.install_model(cfg)
        engine.start_model("kv16")
        prompt = random_prompt(7, seed=4)
        assert greedy(engine, "kv16", prompt, 6) == hf_greedy(llama.model, prompt, 6)
    finally:
        engine.shutdown()


def test_pool_serves_quantized_kv_like_engine(pool, fp32_loader):
    client, _ = pool
    cfg = (fp32_loader.create_reference_runtime_config_builder("pool_kv", "cpu", [0], max_batch=4).max_length(512)
           .kv_cache_span_size(16).kv_cache_mode(AsCacheMode.AsCacheQuantU4).build())
    client.install_model(cfg)
    client.start_model("pool_kv")
    engine = _start(fp32_loader, "pool_kv", AsCacheMode.AsCacheQuantU4)
    try:
        assert json.loads(client.get_model_info("pool_kv"))["kv_cache_mode"] == "uint4"
        for seed, n in ((1, 6), (2, 70)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(client, "pool_kv", prompt, 24) == greedy(engine, "pool_kv", prompt, 24)
    finally:
        engine.release_model("pool_kv")
        engine.shutdown()
        assert client.stop_model("pool_kv") == 0 and client.release_model("pool_kv") == 0


def test_torch_reference_path_serves_quantized_kv_like_native(llama, fp32_loader):
    """ALLSPARK_NO_NATIVE=1: the same model with uint4 KV through the pure-PyTorch path, same tokens."""
    import os
    import subprocess
    import sys

    from test_tensor_parallel import mpirun_env
    here = os.path.dirname(os.path.abspath(__file__))             # tests/models/, and tests/ for helpers
    prompt = random_prompt(30, seed=9)
    code = ("import json, sys; sys.path[:0] = [%r, %r]; from test_kv_quant import _start; from helpers import greedy; "
            "from allspark_server import HuggingFaceModel; "
            "l = HuggingFaceModel(%r, 'kvq'); l.graph_path, l.weights_path = %r, %r; "
            "e = _start(l, 'kvq', 'uint4'); print(json.dumps(greedy(e, 'kvq', %r, 12)))"
            ) % (here, os.path.dirname(here), llama.hf_dir, fp32_loader.graph_path, fp32_loader.weights_path, prompt)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(mpirun_env(), ALLSPARK_NO_NATIVE="1"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = _start(fp32_loader, "kvq_native", "uint4")
    try:
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == greedy(engine, "kvq_native", prompt, 12)
    finally:
        engine.release_model("kvq_native")
        engine.shutdown()
