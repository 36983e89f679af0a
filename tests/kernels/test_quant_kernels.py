"""InstantQuant's native kernels against a float64 dequantize-then-matmul computation on 16-bit x (all formats, group
sizes, odd shapes, 1..64 rows, every ISA level this CPU has), the dequantization, the int8 GEMM of activate_quant
prefill and the native steps on quantized weights; the GEMV on int8 x: test_quant_int8_gemv.py; the formats
themselves: test_quant_formats.py."""
from __future__ import annotations

import pytest
import torch
from quant_cases import (
    assert_linear_quant_matches_float64,
    isa_levels,
    needs_native,
    quant_cases,
    quantized_weight,
    round_to_int8_levels,
)

from allspark_server.compute import ops, reference, step_ops
from allspark_server.quant.formats import FORMAT_IDS, FORMATS, QuantizedWeight, quantize

ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 64]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isa_levels())
def test_linear_quant_matches_float64(dtype, isa):
    assert_linear_quant_matches_float64(quant_cases(), ROWS, dtype, isa, x_seed=4, weight_seed=0)


def test_isa_levels_from_cpu_flags(monkeypatch):
    """py-cpuinfo's names (avx512vnni) reach isa_level in /proc/cpuinfo's spelling (cpu_features.normalized)."""
    from allspark_client.cpu_features import normalized
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    for flags, level in ((avx512 | {"avx512_vnni"}, ops.ISA_AVX512_VNNI), (normalized(avx512 | {"avx512vnni"}), 3),
                         (avx512 | {"avx512_vnni", "avx512_bf16"}, ops.ISA_AVX512_BF16),
                         (normalized(avx512 | {"avx512vnni", "avx512bf16"}), 4),
                         (avx512 | {"avx512_bf16"}, ops.ISA_AVX512),
                         (avx512, ops.ISA_AVX512), ({"avx2", "fma", "avx512_vnni"}, ops.ISA_AVX2), (set(), 0)):
        monkeypatch.setattr(ops, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert ops.isa_level.__wrapped__() == level, flags


def test_cpu_flags_from_proc_cpuinfo():
    """A hand-written /proc/cpuinfo (two processors, x86 `flags`; ARM spells it `Features`)."""
    from allspark_client.cpu_features import parse_proc_cpuinfo
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni\n"
            "bugs\t\t: sysret_ss_attrs\n\nprocessor\t: 1\nflags\t\t: fpu sse2\n")
    assert parse_proc_cpuinfo(text) == {"fpu", "sse2", "avx2", "fma", "avx512f", "avx512_vnni"}
    assert parse_proc_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert parse_proc_cpuinfo("processor\t: 0\n") == frozenset()


@needs_native
@pytest.mark.skipif(ops.isa_level() < ops.ISA_AVX512_VNNI, reason="no AVX-512 VNNI")
def test_vnni_gemv_equals_avx2_and_reference_up_to_fp32_order():
    """The AVX-512 VNNI kernel meets x in the same int16 rounding with exact integer sums: against the AVX2
    kernel and ops.linear_reference (fp32) it differs only by fp32 summation order, for M = 1..16."""
    ext = ops.native()
    g = torch.Generator().manual_seed(5)
    for i, (fmt, n, k, group) in enumerate(quant_cases()):
        qw = quantized_weight(n, k, fmt, group, seed=200 + i)
        nw = ops.native_weight(qw)
        for m in range(1, 17):
            x = torch.randn(m, k, generator=g)
            y3, y1 = ext.linear_quant(x, nw, None, ops.ISA_AVX512_VNNI), ext.linear_quant(x, nw, None, ops.ISA_AVX2)
            scale = (x.abs() @ qw.dequantize().abs().T).max().item()
            assert (y3 - y1).abs().max().item() <= 1e-6 * scale, (fmt, n, k, group, m)
            assert (y3 - ops.linear_reference(x, qw)).abs().max().item() <= 2e-6 * scale, (fmt, n, k, group, m)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_dequantize_weight_matches_reference(isa):
    ext = ops.native()
    for i, (fmt, n, k, group) in enumerate(quant_cases()):
        qw = quantized_weight(n, k, fmt, group, seed=100 + i)
        ref = qw.dequantize()
        assert torch.equal(ext.dequantize_weight(ops.native_weight(qw), torch.float32, isa), ref), (fmt, group)
        assert torch.equal(ext.dequantize_weight(ops.native_weight(qw), torch.bfloat16, isa),
                           ref.to(torch.bfloat16)), (fmt, group)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_round_rows_equals_the_rounding_written_out(isa):
    """The native rounding of many rows (the x of a dequantized activate_quant GEMM) equals, bit for bit, the
    rounding written out here in fp32 torch ops: q = round(x * A / absmax) half to even, times absmax / A, then
    rounded once to the result's dtype; rows of every length around the vector widths, a zero row, bf16 and
    fp32 in and out, both fixed points (A = 127 and 32767)."""
    ext = ops.native()
    g = torch.Generator().manual_seed(21)
    for m, k in ((1, 7), (3, 33), (17, 1536), (40, 4096), (5, 100)):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 5
        x[0] = 0
        for x_dtype in (torch.float32, torch.bfloat16):
            xf = x.to(x_dtype).float()
            amax = xf.abs().amax(-1, keepdim=True)
            for act_max in (127.0, 32767.0):
                inv = torch.where(amax > 0, torch.tensor(act_max) / amax, torch.zeros_like(amax))
                q = torch.round(xf * inv)
                assert q.abs().max() <= act_max
                want = q * (amax / act_max)
                for out in (torch.float32, torch.bfloat16):
                    got = ext.round_rows(x.to(x_dtype), act_max, out, isa)
                    assert got.dtype == out and torch.equal(got, want.to(out)), (m, k, x_dtype, act_max, out)
    with pytest.raises(RuntimeError, match="2-D"):
        ext.round_rows(torch.zeros(4), 127.0, torch.float32, 0)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_quantize_rows_int8_is_the_rounding_written_out(isa):
    """The int8 GEMM's x (activate_quant prefill): q int8 and d per row with q = round(x * 127 / absmax) half to
    even and d = absmax / 127, written out here in fp32 torch ops, bit for bit; a zero row, odd lengths, bf16 and
    fp32 x."""
    ext = ops.native()
    g = torch.Generator().manual_seed(23)
    for m, k in ((1, 7), (3, 33), (17, 1536), (5, 100)):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 5
        x[0] = 0
        for x_dtype in (torch.float32, torch.bfloat16):
            xf = x.to(x_dtype).float()
            amax = xf.abs().amax(-1)
            inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
            q, d = ext.quantize_rows_int8(x.to(x_dtype), isa)
            assert q.dtype == torch.int8 and d.dtype == torch.float32
            assert torch.equal(q, torch.round(xf * inv[:, None]).to(torch.int8)), (m, k, x_dtype)
            assert torch.equal(d, amax / 127.0)


@needs_native
@pytest.mark.parametrize("isa", isa_levels())
def test_scale_int_mm_by_hand(isa):
    """The int8 GEMM's epilogue, y = acc * (d[m] * s[n]) + b[n], on numbers worked out by hand (exact in bf16), and
    at every length around the vector widths against the same formula in float64 (within the fp32 roundings: the
    compiler may fuse the multiply and the add)."""
    ext = ops.native()
    acc = torch.tensor([[3, -4], [100, 0]], dtype=torch.int32)
    d = torch.tensor([0.5, 0.25])
    s = torch.tensor([[2.0], [0.125]]).half()
    b = torch.tensor([1.0, -1.0])
    # row 0: 3 * 0.5 * 2 + 1 = 4, -4 * 0.5 * 0.125 - 1 = -1.25; row 1: 100 * 0.25 * 2 + 1 = 51, 0 - 1 = -1
    for dtype in (torch.float32, torch.bfloat16):
        y = ext.scale_int_mm(acc, d, s, b.to(dtype), dtype, isa)
        assert y.dtype == dtype and y.tolist() == [[4.0, -1.25], [51.0, -1.0]]
    g = torch.Generator().manual_seed(24)
    for n in (1, 7, 8, 15, 16, 17, 33):
        acc = torch.randint(-2 ** 20, 2 ** 20, (5, n), generator=g, dtype=torch.int32)
        d, s = torch.rand(5, generator=g), (torch.rand(n, 1, generator=g) * 0.01).half()
        b = torch.randn(n, generator=g)
        scale = (d[:, None] * s.float().T).double()            # d[m] * s[n] is one fp32 product in both
        for bias in (b, None):
            want = acc.double() * scale + (0 if bias is None else bias.double())
            for dtype in (torch.float32, torch.bfloat16):
                got = ext.scale_int_mm(acc, d, s, bias, dtype, isa)
                ulps = 2 * 2.0 ** -24 + (2.0 ** -8 if dtype == torch.bfloat16 else 0)
                bound = ulps * (acc.double().abs() * scale.abs() + (0 if bias is None else bias.double().abs()))
                assert got.dtype == dtype and ((got.double() - want).abs() <= bound).all(), (n, dtype, bias is None)
    with pytest.raises(RuntimeError, match="per-channel scales"):
        ext.scale_int_mm(acc, d, torch.ones(acc.shape[1], 2).half(), None, torch.float32, isa)
    with pytest.raises(RuntimeError, match="int32"):
        ext.scale_int_mm(acc.float(), d, s, None, torch.float32, isa)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_matches_float64(dtype):
    """activate_quant int8 per-channel prefill as an int8 GEMM (ops.linear_int8_gemm): x rounded as the GEMV rounds
    it, exact integer sums, one scaling: the float64 dequantize-then-matmul of the same rounded x within fp32 (and,
    for bf16, one final rounding); odd shapes, with and without bias."""
    g = torch.Generator().manual_seed(25)
    for i, (m, k, n) in enumerate(((17, 64, 40), (40, 100, 33), (64, 1536, 96), (23, 256, 1))):
        qw = quantized_weight(n, k, "int8", -1, seed=30 + i)
        qw = QuantizedWeight(qw.qweight, qw.scales, None, "int8", -1, k, act_bits=8)
        x = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if i % 2 else None
        y = ops.linear_int8_gemm(x, qw, b)
        ref = round_to_int8_levels(x) @ qw.dequantize().double().T + (0 if b is None else b.double())
        tol = 1e-6 * (x.double().abs() @ qw.dequantize().double().abs().T).max().item()
        rounding = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23)
        assert y.dtype == dtype and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= tol + rounding).all(), (m, k, n, dtype)


@needs_native
def test_ops_linear_takes_the_int8_gemm_only_for_int8_per_channel_activate_quant(monkeypatch):
    """With the int8 GEMM on (the default where the CPU has AMX int8), ops.linear sends prefill rows of an
    activate_quant int8 per-channel weight there and nothing else: grouped, weight-only, 4-bit and uint8 weights,
    up to quant_native_rows rows (the GEMV) and more than INT8_GEMM_MAX_ROWS keep their paths."""
    monkeypatch.setattr(ops, "INT8_GEMM", True)
    calls = []
    real = ops.linear_int8_gemm
    monkeypatch.setattr(ops, "linear_int8_gemm", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(26)
    x = torch.randn(ops.native().quant_native_rows(ops.isa_level()) + 24, 128, generator=g).bfloat16()   # prefill rows
    for fmt, group, act_bits, taken in (("int8", -1, 8, True), ("int8", 64, 8, False), ("int8", -1, 16, False),
                                        ("uint8", -1, 8, False), ("int4", 32, 8, False)):
        q = quantized_weight(48, 128, fmt, group, seed=40)
        qw = QuantizedWeight(q.qweight, q.scales, q.zeros, fmt, group, 128, act_bits=act_bits)
        calls.clear()
        y = ops.linear(x, qw)
        assert bool(calls) == taken, (fmt, group, act_bits)
        ref = reference.round_activations_reference(x, act_bits).double() @ qw.dequantize().double().T
        assert (y.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), (fmt, group, act_bits)
        calls.clear()
        ops.linear(x[:ops.native().quant_native_rows(ops.isa_level())], qw)
        assert not calls
    q = quantized_weight(48, 128, "int8", -1, seed=40)
    qw = QuantizedWeight(q.qweight, q.scales, None, "int8", -1, 128, act_bits=8)
    monkeypatch.setattr(ops, "INT8_GEMM_MAX_ROWS", x.shape[0] - 8)       # above the limit
    ops.linear(x, qw)
    assert not calls
    monkeypatch.setattr(ops, "INT8_GEMM_MAX_ROWS", x.shape[0] + 8)
    monkeypatch.setattr(ops, "INT8_GEMM", False)
    ops.linear(x, qw)
    assert not calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_ops_linear_on_both_sides_of_the_native_row_limit(fmt):
    qw = quantized_weight(96, 128, fmt, 64, seed=7)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(96, generator=g)
    limit = ops.native().quant_native_rows(ops.isa_level()) if ops.native() is not None else 16
    for m in (1, 16, 17, limit, limit + 1):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 128, generator=g).to(dtype)
            y = ops.linear(x, qw, bias.to(dtype))
            ref = x.double() @ qw.dequantize().double().T + bias.to(dtype).double()
            # above the limit the weight is dequantized into x's dtype for ATen's GEMM (bf16: one more rounding)
            tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
            assert y.dtype == dtype and (y.double() - ref).abs().max().item() <= tol, (fmt, m, dtype)


@needs_native
def test_bad_quant_weights_are_refused_with_a_reason():
    ext = ops.native()
    qw = quantized_weight(8, 64, "uint4", 32, seed=9)
    with pytest.raises(RuntimeError, match="zeros"):
        ext.QuantWeight(qw.qweight, qw.scales, None, FORMAT_IDS["uint4"], 64)
    with pytest.raises(RuntimeError, match="columns"):
        ext.QuantWeight(qw.qweight, qw.scales, qw.zeros, FORMAT_IDS["uint4"], 96)
    with pytest.raises(RuntimeError, match="scales"):
        ext.QuantWeight(qw.qweight, qw.scales.float(), qw.zeros, FORMAT_IDS["uint4"], 64)
    with pytest.raises(RuntimeError, match="for K"):
        ext.linear_quant(torch.randn(1, 32), ops.native_weight(qw), None, 0)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "uint8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_steps_take_quantized_weights(fmt, dtype):
    """The native attention and MLP steps with quantized projections: bit-equal to the unfused ops (same kernels,
    same order), and (fp32) equal to the dequantize-then-matmul reference steps. (Per-channel: these shapes' K are
    odd; 4-bit weights run through the whole-model tests.)"""
    from decode_step_cases import _bound_layer, _decode_layer_case, _unfused_attention
    g = torch.Generator().manual_seed(12)
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 4, 2, 16, True)):
        c = _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g)
        for key in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            w = c[key]
            q = quantize(w, fmt, -1)
            c[key] = QuantizedWeight(q["qweight"], q["scales"], q.get("zeros", q.get("mins")), fmt, -1, w.shape[1])
        caches = {name: (c["k_cache"].clone(), c["v_cache"].clone()) for name in ("native", "unfused", "reference")}
        _, attention, norm2, mlp_step = _bound_layer(c, heads, kv_heads, *caches["native"])
        h, s = ops.rms_norm(c["x"], c["norm1"], c["eps"], c["residual"])
        o = step_ops.attention_step(h, attention, c["slots"], c["spans"], c["ctx"], c["cos"], c["sin"])
        assert attention.native is not None                                 # it ran the native step
        assert torch.equal(o, _unfused_attention(h, c, *caches["unfused"], heads, kv_heads))
        assert all(torch.equal(a, b) for a, b in zip(caches["native"], caches["unfused"]))
        h2 = step_ops.norm_step(o, s, norm2)[0]
        mlp = step_ops.mlp_step(h2, mlp_step)
        assert mlp_step.native is not None
        assert torch.equal(mlp, ops.linear(ops.silu_mul(ops.linear(h2, c["gate_up_w"], c["gate_up_b"])),
                                           c["down_w"]))
        if dtype == torch.float32:   # the reference steps on the reference norms
            hr = reference.rms_norm_reference(c["x"], c["norm1"], c["eps"], c["residual"])[0]
            ref_attention = _bound_layer(c, heads, kv_heads, *caches["reference"])[1]
            ref = reference.attention_step_reference(hr, ref_attention, c["slots"], c["spans"], c["ctx"], c["cos"],
                                                     c["sin"])
            assert (o - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
            ref_mlp = reference.mlp_step_reference(reference.rms_norm_reference(o, c["norm2"], c["eps"], s)[0],
                                                   mlp_step)
            assert (mlp - ref_mlp).abs().max().item() <= 1e-4 * max(1.0, ref_mlp.abs().max().item())

    # more rows than the quantized GEMV takes: the MLP step dequantizes the weights for ATen's GEMM
    x = torch.randn(ops.native().quant_native_rows(ops.isa_level()) + 8, c["x"].shape[1], generator=g).to(dtype)
    big = step_ops.mlp_step(ops.rms_norm(x, c["norm2"], c["eps"], x)[0], mlp_step)
    ref = reference.mlp_step_reference(reference.rms_norm_reference(x, c["norm2"], c["eps"], x)[0], mlp_step)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (big.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.float().abs().max().item())
