"""uint4_min (llama.cpp's Q4_1 block: w = code * scale + min per group) end to end: the format against the `gguf`
package's own Q4_1 dequantize, the native CPU kernels (every ISA level this CPU has, batch 1..16 and prefill) and the
Triton kernels (interpreted without a GPU) against float64, and an Engine (and a 2-rank split) serving a model
serialized as uint4_min like transformers running the same model on the codes dequantized here."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from helpers import greedy, hf_greedy, random_prompt, start_engine
from safetensors import safe_open
from test_quant_models import QUANTIZED, serialize_quantized
from test_tensor_parallel import tp_logits

from allspark_client import settings
from allspark_server.compute import ops, reference
from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight, dequantize, quantize, unpack4

FMT = "uint4_min"
needs_native = pytest.mark.skipif(settings.NO_NATIVE.get() or ops.native() is None, reason="native path disabled")


def isa_levels() -> list[int]:
    """Every level this CPU runs: 3 AVX-512 VNNI, 2 AVX-512 (AVX2 GEMV), 1 AVX2, 0 portable."""
    return list(range(ops.isa_level() + 1))


def offset_weight(n: int, k: int, seed: int, offset: float = 0.3) -> torch.Tensor:
    """Weights around `offset` with outlier columns: every group's min is far from zero and from a multiple of its
    scale, so a kernel that dropped or misplaced the min term would be off by much more than rounding."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + offset * torch.rand(n, 1, generator=g)
    w[:, ::7] *= 3
    return w


def weight(n: int, k: int, group: int, seed: int, act_bits: int = 16) -> QuantizedWeight:
    q = quantize(offset_weight(n, k, seed), FMT, group)
    return QuantizedWeight(q["qweight"], q["scales"], q["mins"], FMT, group, k, act_bits)


# ---- the format -----------------------------------------------------------------------------------------------


def test_codes_by_hand():
    # min = -1, scale = 3 / 15 = 0.2 (fp16: 0.199951171875), code = round((w + 1) / scale): 0, 15, 5, 7
    w = torch.tensor([[-1.0, 2.0, 0.0, 0.4] * 8])
    q = quantize(w, FMT, 32)
    s = torch.tensor(0.2).half().item()
    assert set(q) == {"qweight", "scales", "mins"} and q["mins"].dtype == torch.float16
    assert q["scales"].tolist() == [[s]] and q["mins"].tolist() == [[-1.0]]
    assert unpack4(q["qweight"]).tolist() == [[0, 15, 5, 7] * 8]
    want = torch.tensor([c * s for c in (0, 15, 5, 7)], dtype=torch.float32) - 1.0
    assert torch.equal(dequantize(q["qweight"], q["scales"], q["mins"], FMT, 32), want.repeat(8)[None])


@pytest.mark.parametrize("group", [-1, 32, 128])
def test_round_trip_error_bounds(group):
    """Half a step, plus what the fp16 min and scale cost at the ends of a group's range (clamped codes)."""
    w = offset_weight(37, 256, seed=3) * torch.rand(37, 1, generator=torch.Generator().manual_seed(4))
    q = quantize(w, FMT, group)
    back = dequantize(q["qweight"], q["scales"], q["mins"], FMT, group)
    size = 256 if group == -1 else group
    step = q["scales"].float().repeat_interleave(size, dim=1)
    span = w.reshape(37, -1, size).abs().amax(-1).repeat_interleave(size, dim=1)
    err = (back - w).abs()
    assert (err <= 0.5 * step + 2.0 ** -9 * span + 1e-7).all()
    assert (err <= 0.5 * step * (1 + 1e-3) + 1e-7).float().mean() > 0.99
    # its step is never larger than uint4's, whose range always reaches zero: (mostly positive) groups lose less
    q4 = quantize(w, "uint4", group)
    assert err.max() < (dequantize(q4["qweight"], q4["scales"], q4["zeros"], "uint4", group) - w).abs().max()


def gguf_q4_1(w: torch.Tensor) -> np.ndarray:
    """w quantized by the gguf package's own Q4_1 (not ours): its raw blocks [N, K / 32 * 20]."""
    gguf = pytest.importorskip("gguf")
    return gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q4_1)


def from_q4_1(raw: np.ndarray, k: int) -> QuantizedWeight:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles: low j, high 16 + j) -> our tensors, bytes as they are."""
    blocks = torch.from_numpy(raw.reshape(raw.shape[0], k // 32, 20).copy())
    scales = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].contiguous()
    mins = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].contiguous()
    return QuantizedWeight(blocks[..., 4:].reshape(raw.shape[0], k // 2).contiguous(), scales, mins, FMT, 32, k)


def test_gguf_q4_1_blocks_map_bit_for_bit():
    """A GGUF Q4_1 weight taken byte for byte: our dequantize equals the gguf package's, bit for bit."""
    gguf = pytest.importorskip("gguf")
    w = offset_weight(24, 320, seed=5)
    raw = gguf_q4_1(w)
    ours = from_q4_1(raw, 320)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).astype(np.float32))
    assert torch.equal(ours.dequantize(), want.reshape(24, 320))


# ---- native CPU kernels ---------------------------------------------------------------------------------------

# (N, K, G): batch-1 AVX2 paths: NIBBLES16 / NIBBLES8 with runs of eight groups and groups left over (G 32: K 640;
# G 64: K 1024, 640 with 16-bit x, paired groups with int8 x; G 128: K 1536 = 8 + 4, 1280 = 8 + 2), row_grouped_m1
# (K 96 and 288: not whole chunks of 64; 288: eight groups and one more); row_avx2 for M > 1, G 256 and a single
# group; AVX-512: grouped (32..256) and one scale per chunk (G 512, G 1024, per channel, K 640 with a partial chunk)
SHAPES = [(7, 32, 32), (33, 96, 32), (10, 288, 32), (21, 640, 32), (19, 640, 64), (11, 1024, 64), (5, 1536, 128),
          (13, 1280, 128), (130, 512, 256), (9, 1024, 512), (17, 2048, 1024), (21, 640, -1), (6, 1536, 32)]


@needs_native
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("isa", isa_levels())
def test_native_linear_matches_float64(isa, act_bits):
    """Rows 1..16 (the quantized GEMV) in fp32 and bf16 against float64 on the dequantized weight, x rounded as the
    kernel meets it (16-bit or, activate_quant, int8 per row); with a bias on odd rows."""
    ext = ops.native()
    g = torch.Generator().manual_seed(6)
    for i, (n, k, group) in enumerate(SHAPES):
        qw = weight(n, k, group, seed=10 + i, act_bits=act_bits)
        nw = ops.native_weight(qw)
        assert nw.format == FORMAT_IDS[FMT] == 4
        w64 = qw.dequantize().double()
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 8, 13, 16):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dtype)
                b = bias.to(dtype) if m % 2 else None
                y = ext.linear_quant(x, nw, b, isa)
                ref = reference.round_activations_reference(x, act_bits).double() @ w64.T
                ref += 0 if b is None else b.double()
                tol = 1e-5 * (x.double().abs() @ w64.abs().T).max().item() + 1e-6
                rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
                assert y.dtype == dtype and y.shape == (m, n)
                assert ((y.double() - ref).abs() <= tol + rounding).all(), (n, k, group, m, dtype, isa, act_bits)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_native_dequantize_and_prefill(isa):
    """dequantize_weight equals the reference bit for bit (fp32 and bf16; the product rounded before the min is
    added, no fused multiply-add); linear_widened (prefill) and ops.linear above the GEMV's rows match float64."""
    ext = ops.native()
    g = torch.Generator().manual_seed(7)
    for i, (n, k, group) in enumerate(SHAPES):
        qw = weight(n, k, group, seed=40 + i)
        nw = ops.native_weight(qw)
        ref_w = qw.dequantize()
        assert torch.equal(ext.dequantize_weight(nw, torch.float32, isa), ref_w), (n, k, group)
        assert torch.equal(ext.dequantize_weight(nw, torch.bfloat16, isa), ref_w.to(torch.bfloat16)), (n, k, group)
        for m in (17, 40):
            x = torch.randn(m, k, generator=g)
            ref = x.double() @ ref_w.double().T
            tol = 1e-5 * (x.double().abs() @ ref_w.double().abs().T).max().item()
            assert (ext.linear_widened(x, nw, None, isa).double() - ref).abs().max() <= tol, (n, k, group, m)
    x = torch.randn(ext.quant_native_rows(ops.isa_level()) + 8, 640, generator=g)   # above the GEMV's rows: x unrounded
    qw = weight(48, 640, 32, seed=8)
    assert (ops.linear(x, qw).double() - x.double() @ qw.dequantize().double().T).abs().max() <= 1e-4


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_native_kernels_serve_gguf_q4_1_blocks(isa):
    """A GGUF Q4_1 weight (quantized by the gguf package), its bytes as they are: the GEMV against float64 on the
    gguf package's own dequantization."""
    gguf = pytest.importorskip("gguf")
    w = offset_weight(40, 1024, seed=9)
    raw = gguf_q4_1(w)
    qw = from_q4_1(raw, 1024)
    w64 = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).double().reshape(40, 1024)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(10))
    for m in (1, 3):
        y = ops.native().linear_quant(x[:m], ops.native_weight(qw), None, isa).double()
        ref = reference.round_activations_reference(x[:m]).double() @ w64.T
        assert (y - ref).abs().max() <= 1e-5 * (x[:m].double().abs() @ w64.abs().T).max(), (m, isa)


@needs_native
def test_bad_uint4_min_weights_are_refused_with_a_reason():
    ext = ops.native()
    qw = weight(8, 64, 32, seed=11)
    with pytest.raises(RuntimeError, match="uint4_min"):
        ext.QuantWeight(qw.qweight, qw.scales, None, FORMAT_IDS[FMT], 64)
    with pytest.raises(RuntimeError, match="fp16"):
        ext.QuantWeight(qw.qweight, qw.scales, qw.zeros.float(), FORMAT_IDS[FMT], 64)
    with pytest.raises(RuntimeError, match="fp16"):
        ext.QuantWeight(qw.qweight, qw.scales, qw.zeros[:, :1].contiguous(), FORMAT_IDS[FMT], 64)
    with pytest.raises(RuntimeError, match="unknown format"):
        ext.QuantWeight(qw.qweight, qw.scales, qw.zeros, 5, 64)


# ---- Triton kernels (interpreted without a GPU) -----------------------------------------------------------------


def test_triton_quant_matmul_and_dequantize():
    """The Triton GEMV (1-2 rows; the min in the weights with one k-tile a program, as min * sum(x) with several, a
    group per k-tile or several), tensor-core tiles (up to 64; k-tiles smaller than a group) and the prefill
    dequantize + GEMM, split K and not, bias, fp32 / bf16 / fp16 x, against float64 on the weight written out from
    the published formula here."""
    pytest.importorskip("triton")
    from allspark_server.compute.cuda import quant_kernels as qk
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(12)
    for n, k, group in ((40, 256, 32), (24, 256, 128), (16, 288, -1)):
        q = quantize(offset_weight(n, k, seed=n + group), FMT, group)
        size = k if group == -1 else group
        codes = unpack4(q["qweight"]).double()
        exact = codes * q["scales"].double().repeat_interleave(size, 1) + q["mins"].double().repeat_interleave(size, 1)
        w = QuantizedWeight(*(q[t].to(device) for t in ("qweight", "scales", "mins")), FMT, group, k)
        assert torch.equal(qk.dequantize(w, torch.float32).cpu(), dequantize(q["qweight"], q["scales"], q["mins"],
                                                                                FMT, group))
        bias = torch.randn(n, generator=gen)
        for m, dtype, config in ((1, torch.float32, None), (2, torch.bfloat16, None), (5, torch.float16, None),
                                 (17, torch.float32, None), (qk.DOT_MAX_ROWS + 3, torch.float32, None),
                                 (3, torch.float32, qk.LaunchConfig(16, 16, 32, 3)),
                                 (1, torch.float32, qk.LaunchConfig(1, 8, 64, 2)),
                                 (2, torch.bfloat16, qk.LaunchConfig(2, 8, 64, 1))):
            # the GEMV's two ways to add the mins (quant_gemv.py: one k-tile a program, or several) both run
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            b = bias.to(device, dtype) if m % 2 else None
            y = qk.quant_matmul(x, w, b, config)
            ref = x.cpu().double() @ exact.T + (0 if b is None else b.cpu().double())
            assert y.shape == (m, n) and y.dtype == dtype
            eps = torch.finfo(dtype).eps
            bound = 4 * eps * ref.abs() + 1e-5 * (x.cpu().double().abs() @ exact.abs().T).max()
            assert ((y.cpu().double() - ref).abs() <= bound).all(), (n, k, group, m, dtype, config)


def test_triton_silu_mul_epilogue():
    """The GEMV's silu·mul epilogue (SILU_MUL_QUANT_FORMATS has uint4_min): its gate and up sums, then
    fused_kernels.silu_mul's roundings, bit for bit against the two launches."""
    pytest.importorskip("triton")
    from allspark_server.compute.cuda import cuda_ops
    from allspark_server.compute.cuda import fused_kernels as fk
    from allspark_server.compute.cuda import quant_kernels as qk
    assert FMT in cuda_ops.SILU_MUL_QUANT_FORMATS
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = weight(72, 256, 64, seed=13)
    w = QuantizedWeight(w.qweight.to(device), w.scales.to(device), w.zeros.to(device), FMT, 64, 256)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(14)).to(device, torch.float16)
    act = qk.quant_matmul(x, w, silu_mul=True)
    assert act.shape == (1, 36) and torch.equal(act, fk.silu_mul(qk.quant_matmul(x, w)))
    ref = ops.silu_mul_reference((x.cpu().double() @ w.dequantize().cpu().double().T).to(torch.float16))
    assert (act.cpu().double() - ref.double()).abs().max() <= 4e-3 * ref.double().abs().max()


# ---- the Engine -------------------------------------------------------------------------------------------------


def dequantize_here(f, base: str, group: int) -> torch.Tensor:
    """The weight `base` stands for, from its stored tensors, written independently: code * scale + min."""
    q = f.get_tensor(base + ".qweight").numpy()
    n, half = q.shape
    blocks = q.reshape(n, half // 16, 16)
    codes = np.concatenate([blocks & 0xF, blocks >> 4], axis=2).reshape(n, 2 * half).astype(np.float32)
    size = 2 * half if group == -1 else group
    scales = f.get_tensor(base + ".scales").float().numpy()
    mins = f.get_tensor(base + ".mins").float().numpy()
    w = codes.reshape(n, -1, size) * scales[..., None] + mins[..., None]
    return torch.from_numpy(w.reshape(n, 2 * half))


def test_engine_serves_uint4_min_like_transformers(llama, tmp_path):
    """Serialized with customized_quant_config {"weight_format": "uint4_min", "group_size": 32}: the file holds
    qweight / scales / mins (no zeros); greedy decode and chunked prefill equal transformers on those weights."""
    loader = serialize_quantized(llama.hf_dir, "q41", str(tmp_path), {"weight_format": FMT, "group_size": 32})
    ref_model = copy.deepcopy(llama.model)
    with safe_open(loader.weights_path, framework="pt") as f, torch.no_grad():
        keys = set(f.keys())
        assert not any(key.endswith(".zeros") for key in keys)
        replaced = 0
        for name, module in ref_model.named_modules():
            if name.rsplit(".", 1)[-1] in QUANTIZED:
                assert f.get_tensor(name + ".mins").dtype == torch.float16
                assert f.get_tensor(name + ".mins").shape == f.get_tensor(name + ".scales").shape
                module.weight.copy_(dequantize_here(f, name, 32))
                replaced += 1
    assert replaced == 2 * 7
    engine = start_engine(loader, "q41", max_batch=4, max_length=512)
    try:
        info = json.loads(engine.get_model_info("q41"))["quantization"]
        assert info["weight_format"] == FMT and info["group_size"] == 32 and info["quantized_weights"] == 2 * 7
        for seed, n in ((1, 5), (2, 40), (3, 130)):      # decode steps and chunked prefill
            prompt = random_prompt(n, seed=seed)
            assert greedy(engine, "q41", prompt, 24) == hf_greedy(ref_model, prompt, 24), n
    finally:
        engine.release_model("q41")


def test_tp_logits_of_uint4_min_shards_equal_single_process(llama, tmp_path):
    """2 ranks, each reading its slice of the codes, scales and mins (row-parallel o / down: split by groups)."""
    loader = serialize_quantized(llama.hf_dir, "tpq41", str(tmp_path), {"weight_format": FMT, "group_size": 32})
    result = tp_logits(loader, random_prompt(40, seed=21) + random_prompt(16, seed=22), 40, tmp_path)
    assert result["world_size"] == 2 and result["max_abs_diff"] <= 1e-4 and result["argmax_equal"], result
