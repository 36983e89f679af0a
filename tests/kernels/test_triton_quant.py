"""The Triton matmul over InstantQuant weights (allspark_server/cuda/quant_kernels.py) against a float64
dequantize-then-matmul of the same codes: every format and group size, decode and prefill row counts, split-K
and not, odd N, per-channel K that the k-tiles do not divide, bias, fp32 / bf16 / fp16 activations. On a CUDA
machine on the GPU; elsewhere on CPU tensors under the Triton interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from allspark_server.compute.cuda import quant_kernels as qk
from allspark_server.quant.formats import QuantizedWeight, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(n: int, k: int, fmt: str, group: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight with outlier columns (trained-like), quantized: (QuantizedWeight on DEVICE, the float64 weight
    its codes stand for, from the published formula (code - zero) * scale written out here)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, ::7] *= 6
    q = quantize(w, fmt, group)
    g = k if group == -1 else group
    if fmt == "fp8_e4m3":      # OCP E4M3 bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits, written out here
        b = q["qweight"].to(torch.int64)
        e, mant = (b >> 3) & 15, (b & 7).double()
        value = torch.where(e == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * 2.0 ** (e - 7).double())
        exact = torch.where(b >= 128, -value, value) * q["scales"].double().repeat_interleave(g, 1)
        dev = {name: t.to(DEVICE) for name, t in q.items()}
        return QuantizedWeight(dev["qweight"], dev["scales"], None, fmt, group, k), exact
    codes = q["qweight"].to(torch.int16)
    if fmt in ("int4", "uint4"):            # byte j of each 32-block: k = j (low nibble), k = 16 + j (high)
        b = codes.reshape(n, k // 32, 16)
        codes = torch.cat([b & 15, b >> 4], -1).reshape(n, k)
    zero = {"int8": torch.zeros(1), "int4": torch.full((1,), 8.0)}.get(fmt)
    zeros = zero if zero is not None else q["zeros"].double().repeat_interleave(g, 1)
    exact = (codes.double() - zeros.double()) * q["scales"].double().repeat_interleave(g, 1)
    dev = {name: t.to(DEVICE) for name, t in q.items()}
    return QuantizedWeight(dev["qweight"], dev["scales"], dev.get("zeros"), fmt, group, k), exact


def check(x: torch.Tensor, w: QuantizedWeight, exact_w: torch.Tensor, bias=None, config=None) -> None:
    y = qk.quant_matmul(x, w, bias, config)
    assert y.shape == (x.shape[0], w.out_features) and y.dtype == x.dtype
    ref = x.cpu().double() @ exact_w.T
    if bias is not None:
        ref += bias.cpu().double()
    ref_rounded = ref.to(x.dtype).double()
    err = (y.cpu().double() - ref_rounded).abs()
    ulp = torch.finfo(x.dtype).eps * ref.abs().clamp(min=1e-3)
    # fp32 sums in another order than float64's: within a few fp32 ulps of the sum, then x's dtype rounding
    bound = 2 * ulp + 1e-5 * ref.abs().max() * (x.dtype == torch.float32)
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} ({(err > bound).sum().item()} elements over)"


@pytest.mark.parametrize("fmt", ["int8", "uint8", "int4", "uint4", "fp8_e4m3"])
@pytest.mark.parametrize("group", [-1, 32, 128])
def test_formats_and_groups(fmt, group):
    """N = 38 ends in a part tile on every path (the GEMV's 2 or 4 columns, the tiles' 32 and 64); rows: the GEMV, a
    part 16-row tile, a part and a whole 64-row tile (DOT_MAX_ROWS, the most rows before the dequantize-and-GEMM)."""
    n, k = 38, 256
    w, exact = quantized(n, k, fmt, group, seed=len(fmt) + group)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 3, 17, qk.DOT_MAX_ROWS):      # the FMA GEMV, then tensor-core tiles
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            check((torch.randn(m, k, generator=gen)).to(DEVICE, dtype), w, exact)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3"])
def test_split_k_tiles_and_bias(fmt):
    """Explicit configs: 1 and 3 splits of an uneven number of k-tiles; a bias; x a strided row view."""
    n, k = 20, 384          # 20: a part tile of the 32 and of the 8 columns
    w, exact = quantized(n, k, fmt, 64, seed=3)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, k + 8, generator=gen)[:, 8:].to(DEVICE, torch.bfloat16)            # stride(0) = k + 8
    bias = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    for split in (1, 3):
        check(x, w, exact, bias, qk.LaunchConfig(block_m=16, block_n=32, block_k=64, split_k=split))
        # the GEMV: k-tiles of two groups (and of half a group), split or not
        for block_k in (128, 32):
            check(x[:2], w, exact, bias, qk.LaunchConfig(block_m=2, block_n=8, block_k=block_k, split_k=split))
    check(x, w, exact, bias)


@pytest.mark.parametrize("fmt,k", [("int8", 200), ("uint8", 200), ("int4", 288), ("uint4", 288)])
def test_per_channel_k_not_a_multiple_of_the_tile(fmt, k):
    w, exact = quantized(24, k, fmt, -1, seed=k)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 33):
        check(torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16), w, exact,
              config=qk.LaunchConfig(block_m=16 if m == 1 else 64, block_n=16, block_k=128, split_k=2))
        check(torch.randn(m, k, generator=gen).to(DEVICE, torch.float32), w, exact)


def test_choose_config():
    dev = torch.device("cpu")
    gemv = qk.choose_config(1, 4096, 4096, -1, dev)
    assert gemv.block_m <= qk.GEMV_MAX_ROWS and 4096 // gemv.block_k >= gemv.split_k
    few_columns = qk.choose_config(1, 256, 16384, -1, dev)          # too few programs: K split
    assert few_columns.split_k > 1 and 16384 // few_columns.block_k >= few_columns.split_k
    assert qk.choose_config(64, 128000, 4096, -1, dev).split_k == 1          # enough output tiles
    assert qk.choose_config(16, 4096, 4096, 32, dev).block_k == 32   # a tensor-core k-tile inside one group
    assert qk.choose_config(1, 4096, 4096, 32, dev).block_k % 32 == 0  # the GEMV's: whole groups
    wide = qk.choose_config(1, 11008, 4096, -1, dev, "fp8_e4m3")     # fp8's wide programs on a wide weight
    assert (wide.block_n, wide.block_k) == (8, 4096)
    silu = qk.choose_config(1, 11008, 4096, -1, dev, "fp8_e4m3", silu_mul=True)    # a gate and an up row a column
    assert (silu.block_n, silu.block_k) == (4, 4096)
    assert qk.choose_config(1, 4096, 576, -1, dev, "fp8_e4m3").block_k == 1024


def bf16_cast(x32: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as Triton casts: to nearest even on a GPU; the CPU interpreter (Triton 3.x) drops the low
    16 bits instead."""
    if DEVICE == "cuda":
        return x32.to(torch.bfloat16)
    return (x32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("fmt,group", [("int8", -1), ("uint8", 64), ("int4", 32), ("uint4", -1), ("fp8_e4m3", -1),
                                       ("fp8_e4m3", 64)])
def test_prefill_rows_dequantize_for_the_gemm(fmt, group):
    """More than DOT_MAX_ROWS rows: the Triton dequantize (into x's dtype) equals the published formula rounded
    once, and the product equals the float64 one within that rounding."""
    n, k = 40, 256 if group != -1 else 288
    w, exact = quantized(n, k, fmt, group, seed=9)
    assert torch.equal(qk.dequantize(w, torch.float32).cpu(), exact.float())
    assert torch.equal(qk.dequantize(w, torch.bfloat16).cpu(), bf16_cast(exact.float()))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(qk.DOT_MAX_ROWS + 3, k).to(DEVICE, dtype)
        y = qk.quant_matmul(x, w)
        ref = x.cpu().double() @ exact.to(dtype).double().T        # the weight rounded once into x's dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert y.dtype == dtype and (y.cpu().double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "uint8", "int4", "uint4", "fp8_e4m3"])
@pytest.mark.parametrize("group", [-1, 128])
def test_silu_mul_epilogue_equals_the_gemv_then_silu_mul(fmt, group):
    """quant_matmul(silu_mul=True) on the merged gate_up [2I, K]: the GEMV's own sums for the gate and the up rows,
    then fused_kernels.silu_mul's roundings, bit for bit (fp32 and fp16; bf16 within an ulp of the float64
    product rounded the same way: the interpreter's plain bf16 store truncates where the epilogue rounds)."""
    from allspark_server.compute import ops
    from allspark_server.compute.cuda import fused_kernels as fk
    inter, k = 10, 256            # 10 columns: a part tile of the 4-column GEMV
    w, exact = quantized(2 * inter, k, fmt, group, seed=7 + len(fmt) + group)
    gen = torch.Generator().manual_seed(4)
    for m, dtype in ((1, torch.float32), (1, torch.float16), (1, torch.bfloat16), (2, torch.float16)):
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        act = qk.quant_matmul(x, w, silu_mul=True)
        assert act.shape == (m, inter) and act.dtype == dtype
        if dtype != torch.bfloat16 or DEVICE == "cuda":   # the unfused GEMV on the fused launch's tiles
            cfg = qk.choose_config(m, inter, k, group, x.device, fmt, silu_mul=True)
            assert torch.equal(act, fk.silu_mul(qk.quant_matmul(x, w, config=dataclasses.replace(cfg, split_k=1))))
        ref = ops.silu_mul_reference((x.cpu().double() @ exact.T).to(dtype)).to(DEVICE)
        err = (act.double() - ref.double()).abs()
        # fp32 sums against float64's (cancellation: relative to the row's scale, as in `check`), then an ulp
        # in the rounded gate or up, which moves the rounded result by a few ulps
        bound = 4 * torch.finfo(dtype).eps * ref.double().abs() + 1e-5 * ref.double().abs().max()
        assert (err <= bound).all(), f"{dtype}: max error {err.max().item():.3g}"


def test_cuda_backend_fuses_the_quantized_gate_up_at_one_row(monkeypatch):
    from allspark_server.compute import ops
    from allspark_server.compute.cuda import cuda_ops
    from allspark_server.compute.steps import BoundMlp, Mlp
    calls = []
    original = qk.quant_matmul
    monkeypatch.setattr(cuda_ops, "quant_matmul", lambda *a, **kw: calls.append(kw.get("silu_mul", False))
                        or original(*a, **kw))
    hidden, inter = 64, 32
    gate_up, _ = quantized(2 * inter, hidden, "uint4", 32, seed=11)
    gate_up8, _ = quantized(2 * inter, hidden, "int8", -1, seed=13)
    down, _ = quantized(hidden, inter, "int4", 32, seed=12)
    gen = torch.Generator().manual_seed(5)
    norm = torch.ones(hidden, device=DEVICE, dtype=torch.float16)
    # one row: fused for 4-bit codes (SILU_MUL_QUANT_FORMATS), not for 8-bit; two rows: never
    for rows, gate_up, fused in ((1, gate_up, [True, False]), (1, gate_up8, [False, False]),
                                 (2, gate_up, [False, False])):
        x, residual = (torch.randn(rows, hidden, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
        calls.clear()
        h, _ = cuda_ops.rms_norm(x, norm, 1e-6, residual)             # the pre-MLP norm step, then the MLP step
        out = cuda_ops.mlp_step(h, BoundMlp(Mlp(), gate_up, None, down))
        assert calls == fused
        h, _ = ops.rms_norm_reference(x, norm, 1e-6, residual)       # the sequence on the GPU backend's references
        want = cuda_ops.linear_reference(ops.silu_mul_reference(cuda_ops.linear_reference(h, gate_up)), down)
        assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-3), (out, want)


def test_fp8_activations_by_hand():
    """max |x| = 2: 2 / 448 lies in (2^-8, 2^-7], scale 2^-7; x / scale = 128, -256 and 38.4, which e4m3 (3 mantissa
    bits, 1.25 * 2^5 or 1.125 * 2^5 nearest) holds as 40. A row of zeros keeps scale 1."""
    from allspark_server.compute.reference import fp8_activations
    codes, scale = fp8_activations(torch.tensor([[1.0, -2.0, 0.3], [0.0, 0.0, 0.0]]))
    assert codes.dtype == torch.float8_e4m3fn and codes.float().tolist() == [[128, -256, 40], [0, 0, 0]]
    assert scale.tolist() == [[2.0 ** -7], [1.0]]


def activation_rows() -> torch.Tensor:
    """Rows that reach every case of the rounding to e4m3: random at several magnitudes, a row of zeros, values on
    e4m3's ties (x / scale = 1.0625, 17, 0.0146 = 7.5 quanta below 2^-6), values that round up into the next
    binade and to 448, -0, values too small for e4m3 (to 0), a row so small that max / 448 is below fp32's normals,
    one near bf16's largest, and K off the kernel's block."""
    gen = torch.Generator().manual_seed(5)
    k = 2100
    rows = [torch.randn(k, generator=gen) * 10.0 ** p for p in (-3, 0, 2)]
    rows.append(torch.zeros(k))
    ties = torch.zeros(k)
    ties[:8] = torch.tensor([448.0, 1.0625, -17.0, 7.5 * 2 ** -9, 1.9375 + 2 ** -5, 447.0, -0.0, 2.0 ** -12])
    rows.append(ties)
    # max / 448 below fp32's normals, the elements normal (fp32 subnormals in x are not checked: the interpreter's
    # half-precision loads do not keep them)
    rows.append((torch.rand(k, generator=gen) + 1) * torch.randn(k, generator=gen).sign() * 1e-37)
    big = torch.randn(k, generator=gen)
    big[3] = 3.0e38
    rows.append(big)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fp8_rows_in_one_launch_equal_the_reference_bit_for_bit(dtype):
    """fp8_matmul's kernel against reference.fp8_activations (torch's own e4m3 conversion): the same scale and the
    same code byte for every element; rounded_rows = code x scale in x's dtype. A row with inf takes scale 1."""
    from allspark_server.compute.cuda import fp8_matmul
    from allspark_server.compute.reference import fp8_activations
    x = activation_rows()
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    if dtype != torch.float16:
        x[-1, 5] = float("inf")
    x = x.to(DEVICE)
    want_codes, want_scale = fp8_activations(x)
    codes, scale = fp8_matmul.fp8_rows(x)
    assert torch.equal(scale.cpu(), want_scale.cpu()), (scale.flatten(), want_scale.flatten())
    got, want = codes.view(torch.uint8).cpu(), want_codes.view(torch.uint8).cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{len(bad)} codes differ, first at {bad[:4].tolist()}: {got[tuple(bad[0])]} vs " \
        f"{want[tuple(bad[0])]} for x = {x[tuple(bad[0])].item()}"
    rounded = fp8_matmul.rounded_rows(x)
    assert rounded.dtype == dtype
    assert torch.equal(rounded.cpu(), (want_codes.float() * want_scale).to(dtype).cpu())


@pytest.mark.parametrize("m", [1, 2, 5, 70])
def test_fp8_weights_with_fp8_activations(m):
    """activate_quant with fp8_e4m3 weights: x's rows rounded to e4m3 with a power-of-two scale (written out here),
    then the exact product with the weight the codes stand for, within bf16 rounding: the GEMV on the rounded rows
    (1-2 rows) and torch._scaled_mm on the codes (more rows)."""
    import math

    from allspark_server.compute.cuda import cuda_ops, fp8_matmul
    n, k = 48, 128
    w8, exact = quantized(n, k, "fp8_e4m3", -1, seed=21 + m)
    w = QuantizedWeight(w8.qweight, w8.scales, None, "fp8_e4m3", -1, k, act_bits=8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    xd = x.cpu().double()
    rows = []
    for row in xd:
        scale = 2.0 ** math.ceil(math.log2(row.abs().max().item() / 448))
        rows.append((row / scale).float().to(torch.float8_e4m3fn).double() * scale)
    ref = torch.stack(rows) @ exact.T
    for y in (fp8_matmul.fp8_linear(x, w), cuda_ops.linear(x, w)):
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = (y.cpu().double() - ref).abs()
        bound = 2 * torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-3 * ref.abs().max()
        assert (err <= bound).all(), f"max error {err.max().item():.3g}"
    rounded = fp8_matmul.rounded_rows(x).cpu().double()
    assert torch.equal(rounded, torch.stack(rows))             # the GEMV's input: exact in bf16
