"""Alone-rows mode (compute/row_mode.py), the GPU's way of computing a speculative verify step's rows as one-row
steps: in it the CUDA backend's linears and the MLP's gate_up·silu give each of several rows bit for bit what the
same row gives alone (dense and quantized: the one-row GEMV, a program per row and tile, all rows in one launch),
and outside it several rows take the multi-row kernels. On a CUDA machine on the GPU; elsewhere on CPU
tensors under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import DEVICE, assert_same_bits
from test_triton_quant import quantized

from allspark_server.compute.cuda import cuda_ops
from allspark_server.compute.cuda import gemv_kernels as gk
from allspark_server.compute.row_mode import alone, alone_rows, invariant, invariant_rows

ROWS, K, N = 3, 64, 8          # small: the Triton interpreter runs every program on the host


def rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def x_rows(dtype=torch.bfloat16, seed: int = 3) -> torch.Tensor:
    return torch.randn(ROWS, K, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def test_the_mode_nests_and_ends():
    assert not alone()
    with alone_rows():
        assert alone()
        with alone_rows(False):
            assert not alone()
        assert alone()
    assert not alone()


def test_invariant_mode_nests_and_ends():
    assert not invariant()
    with invariant_rows():
        assert invariant() and not alone()
        with invariant_rows(False):
            assert not invariant()
        assert invariant()
    assert not invariant()


def weight(n: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 21])
def test_invariant_rows_equal_each_row_alone_and_float64(dtype, rows):
    """Invariant rows (the tensor-core GEMV): each of up to 16 rows (and, in alone-rows mode, of any number: blocks
    of 16) is bit for bit what it is alone, linear with and without a bias and gate_up·silu; the sums against a
    float64 reference within the output's rounding (k = 200: a partial k-tile, n = 40: a partial n tile)."""
    n, k = 40, 200
    w, gate_up = weight(n, k, 11, dtype), weight(2 * n, k, 12, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(13)).to(DEVICE, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    with invariant_rows(), alone_rows(rows > gk.INVARIANT_MAX_ROWS):
        assert gk.fits(x, w) and gk.fits_silu_mul(x, gate_up)
        y, y_bias, mlp = cuda_ops.linear(x, w), cuda_ops.linear(x, w, bias), cuda_ops.gate_up_silu_mul(x, gate_up)
        assert_same_bits(y, rows_alone(lambda r: cuda_ops.linear(r, w), x))
        assert_same_bits(y_bias, rows_alone(lambda r: cuda_ops.linear(r, w, bias), x))
        assert_same_bits(mlp, rows_alone(lambda r: cuda_ops.gate_up_silu_mul(r, gate_up), x))
    want = x.double() @ w.double().T
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((y.double() - want).abs() <= tol * want.abs() + 1e-3).all()
    assert ((y_bias.double() - want - bias.double()).abs() <= tol * (want + bias.double()).abs() + 1e-3).all()
    g, u = (x.double() @ gate_up.double().T).split(n, -1)
    want_mlp = torch.nn.functional.silu(g) * u
    assert ((mlp.double() - want_mlp).abs() <= 4 * tol * want_mlp.abs() + 2e-3).all()


def test_invariant_rows_past_the_block_take_cublas_outside_alone_rows():
    x, w = x_rows(), weight(N, K, 4)
    wide = torch.randn(gk.INVARIANT_MAX_ROWS + 1, K).to(DEVICE, torch.bfloat16)
    with invariant_rows():
        assert gk.fits(x, w) and not gk.fits(wide, w)
        assert not gk.fits(x.float(), w.float())         # fp32: cuBLAS
        with alone_rows():
            assert gk.fits(wide, w)


def test_dense_rows_take_the_gemv_and_equal_each_row_alone():
    x = x_rows()
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(4)) / K ** 0.5).to(DEVICE, torch.bfloat16)
    gate_up = (torch.randn(2 * N, K, generator=torch.Generator().manual_seed(5)) / K ** 0.5).to(DEVICE, torch.bfloat16)
    assert not gk.fits(x, w)                            # three rows: the multi-row kernel
    with alone_rows():
        assert gk.fits(x, w) and gk.fits_silu_mul(x, gate_up)
        assert_same_bits(cuda_ops.linear(x, w), rows_alone(lambda r: cuda_ops.linear(r, w), x))
        assert_same_bits(cuda_ops.gate_up_silu_mul(x, gate_up),
                         rows_alone(lambda r: cuda_ops.gate_up_silu_mul(r, gate_up), x))
    # a row alone is what it is outside the mode: the mode changes several rows only
    assert_same_bits(rows_alone(lambda r: cuda_ops.linear(r, w), x), torch.cat(
        [gk.gemv(x[i:i + 1], w) for i in range(ROWS)]))


@pytest.mark.parametrize("fmt,group,rows", [("int4", 32, 3), ("uint4", 32, 5), ("uint8", 64, 5),
                                             ("int4", -1, 2), ("int4", 32, 17)])
def test_quantized_rows_equal_each_row_alone_from_one_launch(fmt, group, rows, monkeypatch):
    w, _ = quantized(N, K, fmt, group, seed=6)
    gate_up, _ = quantized(2 * N, K, fmt, group, seed=7)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
    alone_linear = rows_alone(lambda r: cuda_ops.linear(r, w), x)
    alone_mlp = rows_alone(lambda r: cuda_ops.gate_up_silu_mul(r, gate_up), x)
    launches = []
    real = cuda_ops.quant_matmul
    monkeypatch.setattr(cuda_ops, "quant_matmul", lambda x, *a, **kw: launches.append(x.shape[0]) or real(x, *a, **kw))
    with alone_rows():
        assert_same_bits(cuda_ops.linear(x, w), alone_linear)
        if fmt in cuda_ops.SILU_MUL_QUANT_FORMATS:
            assert_same_bits(cuda_ops.gate_up_silu_mul(x, gate_up), alone_mlp)
    assert launches == [rows] * (2 if fmt in cuda_ops.SILU_MUL_QUANT_FORMATS else 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes: K split over programs, many k-tiles (GPU)")
@pytest.mark.parametrize("fmt", ["dense", "int4", "uint8"])
def test_rows_alone_at_a_7b_layers_shapes(fmt):
    n, k = 4096, 11008 if fmt == "dense" else 4096
    if fmt == "dense":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(8)) / k ** 0.5).to(DEVICE, torch.bfloat16)
    else:
        w, _ = quantized(n, k, fmt, 128, seed=8)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16)
    with alone_rows():
        assert_same_bits(cuda_ops.linear(x, w), rows_alone(lambda r: cuda_ops.linear(r, w), x))
