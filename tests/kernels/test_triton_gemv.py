"""The Triton decode GEMV (allspark_server/cuda/gemv_kernels.py) against float64 torch: y = x @ w.T rounded once
to bf16 / fp16, with and without a bias, over odd N, K off the tile, strided rows of x, one and two rows; the
fused silu·mul epilogue bit for bit against the GEMV followed by fused_kernels.silu_mul, and within an ulp of
float64; which linears the CUDA backend hands it (`fits`). On a CUDA machine on the GPU; elsewhere on CPU
tensors under the Triton interpreter (small shapes)."""
from __future__ import annotations

import pytest
import torch

from allspark_client import settings

pytest.importorskip("triton")

from test_triton_fused import DEVICE, assert_same_bits, assert_within_ulps, rows_view

from allspark_server.compute import ops
from allspark_server.compute.cuda import fused_kernels as fk
from allspark_server.compute.cuda import gemv_kernels as gk

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bfloat16", "float16"]
SMALL = gk.GemvConfig(block_n=4, block_k=64, num_warps=2)    # several k-tiles and a partial one at K = 200
CASES = [  # (rows, N, K, config): N off the 4-row tile, K off the 64-wide k-tile, K inside one tile
    (1, 37, 200, SMALL), (2, 37, 200, SMALL), (1, 8, 256, SMALL), (2, 19, 48, None), (1, 64, 1000, None),
]


def weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)


def exact_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) in float64, rounded once to x's dtype."""
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n,k,config", CASES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_rounds_the_exact_product_once(dtype, rows, n, k, config, with_bias, poisoned_empty):
    x = rows_view(rows, k, dtype, seed=k)                                                # [M, K] strided
    w = weight(n, k, dtype, seed=n)
    bias = weight(1, n, dtype, seed=3)[0] if with_bias else None
    y = gk.gemv(x, w, bias, config)
    # fp32 sums in another order than float64's: the one rounding lands on a neighbour at most, rarely
    assert_within_ulps(y, exact_linear(x, w, bias), 1, max_mismatch=0.05)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter,k,config", [(1, 37, 200, SMALL), (2, 21, 96, SMALL), (1, 40, 512, None)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_silu_mul_equals_gemv_then_silu_mul(dtype, rows, inter, k, config, with_bias, poisoned_empty):
    x = rows_view(rows, k, dtype, scale=4.0, seed=k)
    gate_up = weight(2 * inter, k, dtype, seed=inter)                                   # [2I, K]: gate rows, up rows
    bias = weight(1, 2 * inter, dtype, seed=5)[0] if with_bias else None
    act = gk.gemv_silu_mul(x, gate_up, bias, config)
    # the same sums (same tiles) and the roundings of ops.silu_mul: bit for bit
    assert_same_bits(act, fk.silu_mul(gk.gemv(x, gate_up, bias, config)))
    # and against float64's product, rounded as the model rounds it (linear, then silu·mul's two roundings):
    # an ulp off in the rounded gate or up moves the result by at most ~2 ulps
    assert_within_ulps(act, ops.silu_mul_reference(exact_linear(x, gate_up, bias)), 3, max_mismatch=0.05)


def test_fits_only_decode_rows_of_half_precision_weights():
    w = weight(8, 64, torch.bfloat16, seed=0)
    x = rows_view(2, 64, torch.bfloat16)
    assert gk.fits(x[:1], w) and gk.fits(x, w)
    assert not gk.fits(rows_view(3, 64, torch.bfloat16), w), "more than GEMV_MAX_ROWS rows: cuBLAS"
    assert not gk.fits(x.float(), w.float()), "fp32: cuBLAS"
    assert not gk.fits(x.half(), w), "x and w in different dtypes"
    assert not gk.fits(x, weight(64, 8, torch.bfloat16, seed=0).T), "a transposed (non-contiguous) weight"
    assert not gk.fits(x[:0], w), "no rows"
    assert gk.fits_silu_mul(x[:1], w) and not gk.fits_silu_mul(x, w), "the silu·mul epilogue at one row only"
    with settings.override(TRITON_GEMV=False):
        assert not gk.fits(x, w), "switched off"
    assert gk.fits(x, w), "on again after the override"


def test_cuda_backend_routes_decode_linears_through_the_gemv(monkeypatch):
    from allspark_server.compute.cuda import cuda_ops
    from allspark_server.compute.reference import mlp_step_reference
    from allspark_server.compute.steps import BoundMlp, Mlp
    calls = []
    for name in ("gemv", "gemv_silu_mul"):
        original = getattr(gk, name)
        monkeypatch.setattr(gk, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    dtype, hidden, inter = torch.bfloat16, 64, 48
    x, residual = rows_view(1, hidden, dtype, seed=1), rows_view(1, hidden, dtype, seed=2)
    norm = torch.ones(hidden, device=DEVICE, dtype=dtype)
    gate_up, down = weight(2 * inter, hidden, dtype, seed=3), weight(hidden, inter, dtype, seed=4)
    mlp = BoundMlp(Mlp(), gate_up, None, down)

    def norm_then_mlp(x, residual):     # the layer's pre-MLP norm step, then its MLP step, on the CUDA backend
        h, s = cuda_ops.rms_norm(x, norm, 1e-6, residual)
        return cuda_ops.mlp_step(h, mlp), s

    def reference_norm_then_mlp(x, residual):
        h, s = ops.rms_norm_reference(x, norm, 1e-6, residual)
        return mlp_step_reference(h, mlp), s
    out, s = norm_then_mlp(x, residual)
    assert calls == ["gemv_silu_mul", "gemv"]
    ref, ref_s = reference_norm_then_mlp(x, residual)
    assert_same_bits(s, ref_s)
    assert_within_ulps(out, ref, 4, max_mismatch=0.2)
    calls.clear()
    x2, residual2 = rows_view(2, hidden, dtype, seed=5), rows_view(2, hidden, dtype, seed=6)
    out, _ = norm_then_mlp(x2, residual2)                                                # 2 rows: no epilogue
    assert calls == ["gemv", "gemv"]
    assert_within_ulps(out, reference_norm_then_mlp(x2, residual2)[0], 4, max_mismatch=0.2)
    calls.clear()
    cuda_ops.linear(rows_view(3, hidden, dtype), down.T.contiguous())                      # 3 rows: cuBLAS
    assert calls == []


def test_a_wide_weight_of_few_columns_takes_more_rows_a_program(poisoned_empty):
    """A small model's LM head (k <= 1024, 16384 rows or more) takes 8 rows a program and 4 warps (choose_config).
    That tile (on a narrower weight here: the interpreter runs every program) still rounds the exact product once,
    and in alone-rows mode each of several rows is what it is alone; an adapter's shrink, whose programs a launch of
    4 warps cannot carry, runs in its own launch with the same bits."""
    from allspark_server.compute.cuda import lora_kernels as lk
    from allspark_server.compute.row_mode import alone_rows
    n, k = 40, 48
    cfg = gk.choose_config(k, 16384)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps) == (8, 64, 4)
    assert gk.choose_config(k, 8192, silu_mul=True) == cfg          # 8192 gate / up pairs: 16384 weight rows
    assert gk.choose_config(k, 4096, silu_mul=True).num_warps == 8
    assert gk.choose_config(4096, 16384).num_warps == 8 and gk.choose_config(k, 8192).num_warps == 8
    w = weight(n, k, torch.bfloat16, seed=31)
    x = rows_view(3, k, torch.bfloat16, seed=32)
    assert_within_ulps(gk.gemv(x[:1], w, config=cfg), exact_linear(x[:1], w, None), 1, max_mismatch=0.05)
    with alone_rows():
        assert_same_bits(gk.gemv(x, w, config=cfg), torch.cat([gk.gemv(x[i:i + 1], w, config=cfg) for i in range(3)]))
    a_stack = weight(2 * 8, k, torch.bfloat16, seed=33).view(2, 8, k)
    b_stack = weight(2 * n, 8, torch.bfloat16, seed=34).view(2, n, 8)
    slots = torch.tensor([1, -1, 0], device=DEVICE)
    want = gk.gemv(x, w, config=cfg)
    lk.lora_add_(want, x, a_stack, b_stack, slots)
    got = gk.gemv(x, w, config=cfg, lora=lk.Shrink.of(x, a_stack, b_stack, slots))
    assert_same_bits(got, want)


@pytest.mark.parametrize("k", [576, 1536, 2048, 3584, 4096, 5120, 8192, 11008, 14336])
@pytest.mark.parametrize("inter", [1536, 4096, 5504, 8192, 11008, 14336, 18944])
def test_gate_up_takes_one_tile_with_and_without_silu_mul(k, inter):
    """A batch with an adapter row runs gate_up as a plain GEMV and silu·mul after it (the deltas go in before the
    activation); its base rows keep their bits only if the plain launch over the 2 * inter weight rows takes the
    tile of the fused launch over inter gate / up pairs. The tiles of the projections an adapter may target carry
    its shrink (SHRINK_WARPS warps) where the input has more than 1024 columns."""
    from allspark_server.compute.cuda import lora_kernels as lk
    fused, plain = gk.choose_config(k, inter, silu_mul=True), gk.choose_config(k, 2 * inter)
    assert fused == plain, (k, inter, fused, plain)
    for n in (inter, 2 * inter, k, 3 * k, k + 2 * (k // 4)):    # down, gate_up, o, q|k|v with and without GQA
        assert k <= 1024 or gk.choose_config(k, n).num_warps == lk.SHRINK_WARPS, (k, n)
