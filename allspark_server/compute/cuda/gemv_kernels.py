"""Triton GEMV for decode rows with bf16 / fp16 weights: y = x @ w.T for a row or two of x, the weight streamed
once from memory, optionally with the MLP's silu·mul as its epilogue (the merged gate_up projection in, the
activation out: no [M, 2I] intermediate and no separate launch).

Why not cuBLAS: at one row a linear layer is a pure weight stream, which cuBLAS reads at 1.94-2.78 TB/s for the
7B shapes and their 2-rank shards on an H100, this kernel at 2.30-3.11 (benchmarks/cuda_gemv_micro.py; the whole
batch-1 step 1.15x faster). Each program owns BLOCK_N rows of w and walks K in BLOCK_K tiles with K contiguous,
one fp32 sum per output, rounded once into x's dtype (cuBLAS rounds once too; only the order of the fp32 sum
differs). More rows, fp32 or other layouts stay with cuBLAS (`fits`).

Batch-invariant rows (row_mode.invariant(): a speculating model on a GPU): `_rows_dot_kernel` instead, on tensor
cores. A program takes BLOCK_N weight rows as the MMA's M side and up to 16 rows of x, padded with zeros, as its N
side, so one compiled kernel runs the same instructions for 1 to 16 rows and a row's sums never depend on the others:
a verify chunk's k + 1 rows read the weight once and come out as each would alone. At one row it streams the weight
~6% slower than the FMA kernel (7B shapes, H200: benchmarks/results/exact-rows-micro-h200.json), at five rows
~3.5x faster than a program per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from allspark_client import settings
from allspark_server.compute import row_mode
from allspark_server.compute.cuda import lora_kernels, pdl
from allspark_server.compute.cuda.fused_kernels import _round, _silu_mul_rounded
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous

# rows of x the kernel takes; more: cuBLAS, which wins from four rows. The silu·mul epilogue pays at one row only:
# its two weight tiles a k-step load twice the registers (benchmarks/results/cuda-gemv-micro-h100.json).
GEMV_MAX_ROWS = 2
SILU_MUL_MAX_ROWS = 1
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _weight_tiles(rows, up_rows, offs_k, n_ok, K, SILU_MUL: tl.constexpr, EVICTION: tl.constexpr):
    """Columns offs_k [BLOCK_K] of the weight rows `rows` [BLOCK_N, 1] (pointers) and, with SILU_MUL, of the
    up rows `up_rows` below them, in fp32 (0 where masked): ([BN, BK], [BN, BK]; the second unused otherwise)."""
    ok = n_ok[:, None] & (offs_k < K)[None, :]
    wt = tl.load(rows + offs_k[None, :], mask=ok, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    wu = wt
    if SILU_MUL:
        wu = tl.load(up_rows + offs_k[None, :], mask=ok, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return wt, wu


@triton.jit
def _accumulate(acc, acc_up, wt, wu, x, offs_m, offs_k, M, K, stride_xm, BLOCK_M: tl.constexpr,
                SILU_MUL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] plus the weight tile wt [BLOCK_N, BLOCK_K] met by columns offs_k of each row of x
    (and acc_up plus wu's, with SILU_MUL)."""
    for i in tl.static_range(BLOCK_M):
        # rows past M repeat the last (their sums are never stored)
        xi = tl.load(x + tl.minimum(i, M - 1) * stride_xm + offs_k, mask=offs_k < K, other=0.0)
        xi = xi.to(tl.float32)[None, :]                                                 # [1, BK]
        acc = tl.where(offs_m[:, None] == i, acc + tl.sum(wt * xi, 1)[None, :], acc)
        if SILU_MUL:
            acc_up = tl.where(offs_m[:, None] == i, acc_up + tl.sum(wu * xi, 1)[None, :], acc_up)
    return acc, acc_up


@triton.jit(do_not_specialize=["grid_rows"])
def _gemv_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, up_rows, grid_rows,
                 a_stack, slots, part, R, stride_as, stride_ar, stride_pt, stride_ps, shrink_programs, r_blocks,
                 splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SHRINK: tl.constexpr, BLOCK_R: tl.constexpr,
                 CHUNK: tl.constexpr, EVICTION: tl.constexpr, SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program = BLOCK_N outputs: y[:M, n] = sum_k x[:M, k] w[n, k] (+ bias[n]) in fp32, rounded once to out's
    dtype. SILU_MUL: rows n and up_rows + n of w are a gate and an up row; out = silu(gate) * up, rounded where
    ops.silu_mul rounds (gate, up, silu(gate), the product). PDL (pdl.py): the first k-tile of the weight is
    loaded before waiting for the kernel that writes x. grid_rows: programs per BLOCK_N outputs, each on its own
    row of x and of out (alone-rows mode: M = 1 a program; 1 otherwise), neighbours in the grid, so that a weight
    tile read from memory for one row is in L2 for the others. SHRINK: the first shrink_programs programs are a
    LoRA adapter's shrink (lora_kernels.shrink_program, (row, r-block, k-chunk) with the chunk fastest), so that
    only its expand needs a launch of its own."""
    allow_next(PDL)
    pid = tl.program_id(0)
    if SHRINK:
        if pid < shrink_programs:
            per_row = r_blocks * splits
            lora_kernels.shrink_program(pid // per_row, pid % per_row // splits, pid % splits, x, a_stack, slots, part,
                                        K, R, stride_xm, stride_as, stride_ar, stride_pt, stride_ps, BLOCK_R, CHUNK,
                                        CHUNK, PDL)
            return
        pid -= shrink_programs
    x += (pid % grid_rows).to(tl.int64) * stride_xm
    out += (pid % grid_rows).to(tl.int64) * stride_om
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = (pid // grid_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w + offs_n.to(tl.int64)[:, None] * stride_wn                                 # [BN, 1]
    up = rows + up_rows * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    wt, wu = _weight_tiles(rows, up, offs_k, n_ok, K, SILU_MUL, EVICTION)
    wait_for_previous(PDL)
    acc, acc_up = _accumulate(acc, acc_up, wt, wu, x, offs_m, offs_k, M, K, stride_xm, BLOCK_M, SILU_MUL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wt, wu = _weight_tiles(rows, up, offs_k, n_ok, K, SILU_MUL, EVICTION)
        acc, acc_up = _accumulate(acc, acc_up, wt, wu, x, offs_m, offs_k, M, K, stride_xm, BLOCK_M, SILU_MUL)
    dt = out.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias + up_rows + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, dt, SOFT_BF16)
    if SILU_MUL:   # gate and up rounded as the linear rounds them, then silu·mul's roundings
        y = _silu_mul_rounded(y, _round(acc_up, dt, SOFT_BF16), dt, SOFT_BF16)
    dst = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(dt), mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _dot_tile(acc, rows, w_ok, x, offs_m, m_ok, k0, K, stride_xm, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
              FIRST: tl.constexpr, PDL: tl.constexpr):
    """acc [W, BLOCK_M] plus the k-tile [k0, k0 + BLOCK_K) of the weight rows `rows` [W, 1] (pointers) met by x's rows
    on tensor cores. FIRST: the tile the program starts with, its weight read before the PDL wait."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    wt = tl.load(rows + offs_k[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0,
                 eviction_policy="evict_first")                                          # [W, BK]
    if FIRST:
        wait_for_previous(PDL)
    xt = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
    if SOFT_BF16:   # the interpreter's dot of 16-bit floats is wrong: theirs in fp32 (products and sums exact)
        wt, xt = wt.to(tl.float32), xt.to(tl.float32)
    return tl.dot(wt, xt, acc)


@triton.jit
def _rows_dot_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, up_rows, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, W_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (n tile, block of BLOCK_M rows of x): out[rows, n] = sum_k x[rows, k] w[n, k] (+ bias[n]) as
    tl.dot(w tile [W_ROWS, BK], x^T tile [BK, BLOCK_M]) over the k-tiles, rows past M zero; rounded and, with SILU_MUL,
    silu(gate) * up as _gemv_kernel does, the BLOCK_N gate rows and their up rows one tile of W_ROWS = 2 BLOCK_N.
    Every block of rows runs the same instructions: batch invariant."""
    allow_next(PDL)
    row0 = tl.program_id(1) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M - row0
    x += row0.to(tl.int64) * stride_xm
    offs_w = tl.arange(0, W_ROWS)
    n_w = tl.program_id(0) * BLOCK_N + offs_w % BLOCK_N                                 # each weight row's output
    w_ok = n_w < N
    rows = w + (n_w + (offs_w // BLOCK_N) * up_rows).to(tl.int64)[:, None] * stride_wn  # [W, 1]
    acc = tl.zeros((W_ROWS, BLOCK_M), dtype=tl.float32)
    acc = _dot_tile(acc, rows, w_ok, x, offs_m, m_ok, 0, K, stride_xm, BLOCK_K, SOFT_BF16, True, PDL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc = _dot_tile(acc, rows, w_ok, x, offs_m, m_ok, k0, K, stride_xm, BLOCK_K, SOFT_BF16, False, PDL)
    if HAS_BIAS:
        acc += tl.load(bias + n_w + (offs_w // BLOCK_N) * up_rows, mask=w_ok, other=0.0).to(tl.float32)[:, None]
    dt = out.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SILU_MUL:   # [2 BN, BM] -> gate, up [BN, BM], rounded as the linear rounds them, then silu·mul's roundings
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        y = _silu_mul_rounded(_round(gate, dt, SOFT_BF16), _round(up, dt, SOFT_BF16), dt, SOFT_BF16)
    else:
        y = _round(acc, dt, SOFT_BF16)
    dst = out + (row0 + offs_m).to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, y.to(dt), mask=m_ok[None, :] & (offs_n < N)[:, None])


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    eviction: str = "evict_first"     # the weight's loads: streamed once ("" for the default policy)


def choose_config(k: int, n: int = 0, silu_mul: bool = False) -> GemvConfig:
    """Tile shape for a weight of k columns and n outputs (silu_mul: gate_up's, 2n weight rows). From
    benchmarks/cuda_gemv_micro.py's sweep on an H100 over the 7B shapes and their 2-rank shards: two rows a program
    and 8 warps were best for every shape, with 2048-wide k-tiles, or 4096 for K = 11008 (the best config read
    2.32-3.09 TB/s, cuBLAS 1.96-2.67; the worst, eight rows of 1024, 1.73-2.62). A wide weight of few columns (a
    small model's LM head: k <= 1024, 16384 rows or more) takes 8 rows a program and 4 warps: two rows made 24576
    programs of a few kilobytes each for SmolLM2's 49152 x 576 head, which read 1.4 TB/s against 3.4 (H200,
    `--shapes smollm2`). Two more from the H200's sweep (`--lora-sweep`), which also times each tile carrying an
    adapter's shrink and followed by its expand (a LoRA row's batch-1 projection): a weight of 16384 rows or more
    and 2048 to 8192 columns (gate_up's gate and up rows, a 7B LM head) takes 4 rows a program, where the shrink's
    programs added ~2 us to gate_up's launch with two rows a program and nothing with four; a weight of 2048 to
    4096 columns and as many rows or more, up to 4096 (o, whole or a 2-rank pool's shard) takes 8 rows and
    1024-wide k-tiles, the same time alone or less and ~1 us less with an adapter (q|k|v's shard, 3072 x 4096, lost
    ~1 us with it). (In the H100's sweep, which had no adapters, neither tile was among a shape's best six.) A
    weight's tile depends on the weight alone, never on the rows or on an adapter: gate_up with and without
    silu·mul take one tile (a batch with an adapter row drops the epilogue and keeps each row's sums), and the rows
    of x never choose, so each comes out as it would alone. The tiles of weights of more than 1024 columns have
    SHRINK_WARPS warps: their launch can carry an adapter's shrink."""
    weight_rows = n * (2 if silu_mul else 1)
    if k <= 1024 and weight_rows >= 16384:
        return GemvConfig(block_n=8, block_k=triton.next_power_of_2(k), num_warps=4)
    if weight_rows >= 16384 and 2048 <= k <= 8192:
        return GemvConfig(block_n=4, block_k=2048, num_warps=8)
    if 2048 <= k <= weight_rows <= 4096:
        return GemvConfig(block_n=8, block_k=1024, num_warps=8)
    return GemvConfig(block_n=2, block_k=min(4096 if k >= 8192 else 2048, triton.next_power_of_2(k)), num_warps=8)


# batch-invariant rows: up to INVARIANT_MAX_ROWS (one block of _rows_dot_kernel's rows) take that kernel
INVARIANT_MAX_ROWS = 16


def choose_dot_config(n: int, silu_mul: bool = False) -> GemvConfig:
    """_rows_dot_kernel's tile for n outputs (silu_mul: n gate and n up rows), from benchmarks/exact_rows_micro.py's
    sweeps on an H200 over the 7B shapes: 128-wide k-tiles; 64 weight rows a program, 4 warps, 6 stages where n is
    2048..8191 (the o and down projections), 4 stages from 16384 (the LM head); 32 rows, 2 warps, 6 stages where more
    programs pay (qkv, small models); gate_up·silu's 32 gate and 32 up rows with 2 warps and 4 stages (the 6-stage
    64 + 64 row tile is more than the shared memory). It depends on the weight alone, never on the rows: that is
    what keeps them invariant."""
    if silu_mul:
        return GemvConfig(block_n=32, block_k=128, num_warps=2, num_stages=4)
    if n >= 16384:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if 2048 <= n < 8192:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6)
    return GemvConfig(block_n=32, block_k=128, num_warps=2, num_stages=6)


def enabled() -> bool:
    """ALLSPARK_TRITON_GEMV=0 keeps every dense linear on cuBLAS (A/B runs)."""
    return settings.TRITON_GEMV.get()


def decode_rows(x: torch.Tensor, max_rows: int) -> bool:
    """x is 1..max_rows unit-stride rows: what a GEMV (this one or the quantized one) takes."""
    return x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.stride(-1) == 1


def fits(x: torch.Tensor, w: torch.Tensor, max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Whether gemv takes x @ w.T: up to `max_rows` decode rows (invariant rows: INVARIANT_MAX_ROWS; any number in
    alone-rows mode: a row's sums do not depend on the others), a contiguous bf16 / fp16 weight in x's dtype, and
    the switch on."""
    if row_mode.invariant():
        max_rows = INVARIANT_MAX_ROWS
    if row_mode.alone():
        max_rows = x.shape[0] if x.dim() == 2 else max_rows
    return (decode_rows(x, max_rows) and w.dtype in DTYPES and x.dtype == w.dtype and w.dim() == 2
            and w.is_contiguous() and enabled())


def fits_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether gemv_silu_mul takes the MLP's gate_up projection and activation (`fits`, at most SILU_MUL_MAX_ROWS;
    invariant rows: INVARIANT_MAX_ROWS)."""
    return fits(x, gate_up, SILU_MUL_MAX_ROWS)


def _launch(x, w, bias, out_cols, up_rows, silu_mul, config, lora=None):
    m, k = x.shape
    assert w.shape[1] == k and x.stride(-1) == 1 and w.is_contiguous(), (tuple(x.shape), tuple(w.shape))
    assert bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous())
    assert lora is None or not silu_mul, "an adapter's deltas go in before the activation: no silu·mul epilogue"
    out = torch.empty(m, out_cols, dtype=x.dtype, device=x.device)                       # [M, N]
    if m == 0 or out_cols == 0:
        return out
    invariant = row_mode.invariant()
    cfg = config or (choose_dot_config(out_cols, silu_mul) if invariant else choose_config(k, out_cols, silu_mul))
    plan = lora if lora is not None and not lora.empty else None
    s = plan                                                                    # the shrink this launch carries
    if s is not None and (invariant or cfg.num_warps != lora_kernels.SHRINK_WARPS):
        # a launch that cannot carry the shrink's programs (the tensor-core kernel, or other warps than the shrink's
        # own): the shrink in its own launch, and the GEMV's tile what it is without an adapter
        lora_kernels.shrink_(x, s)
        s = None
    if invariant:
        out = _launch_invariant(x, w, bias, out, up_rows, silu_mul, cfg)
        if plan is not None:
            lora_kernels.expand_(out, plan)
        return out
    # alone-rows mode: a program a row, each the one-row launch's (M = 1, BLOCK_M = 1), so its sums are the same
    grid_rows = m if row_mode.alone() else 1
    rows = m // grid_rows                                                               # rows a program
    a_stack, slots, part = (s.a_stack, s.slots, s.part) if s else (w, w, w)     # unread without a shrink
    programs = s.programs if s else 0
    _gemv_kernel[(programs + triton.cdiv(out_cols, cfg.block_n) * grid_rows,)](
        x, w, w if bias is None else bias, out, rows, out_cols, k, x.stride(0), w.stride(0), out.stride(0),
        up_rows, grid_rows, a_stack, slots, part, s.rank if s else 0, a_stack.stride(0), a_stack.stride(-2),
        part.stride(0), part.stride(1), programs, s.r_blocks if s else 1, s.splits if s else 1,
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, SHRINK=s is not None, BLOCK_R=s.block_r if s else 16, CHUNK=s.chunk if s else 16,
        EVICTION=cfg.eviction, SOFT_BF16=_INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False, **pdl.launch_options(x.device))
    if plan is not None:
        lora_kernels.expand_(out, plan)
    return out


def _launch_invariant(x, w, bias, out, up_rows, silu_mul, cfg):
    m, k = x.shape
    _rows_dot_kernel[(triton.cdiv(out.shape[1], cfg.block_n), triton.cdiv(m, INVARIANT_MAX_ROWS))](
        x, w, w if bias is None else bias, out, m, out.shape[1], k, x.stride(0), w.stride(0), out.stride(0), up_rows,
        BLOCK_M=INVARIANT_MAX_ROWS, BLOCK_N=cfg.block_n, W_ROWS=cfg.block_n * (2 if silu_mul else 1),
        BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SOFT_BF16=_INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **pdl.launch_options(x.device))
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, lora: "lora_kernels.Shrink | None" = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype (any M runs; `fits` says where it pays).
    lora (lora_kernels.Shrink.of(x, a_stack, b_stack, slots)): each row's adapter delta added as lora_add_ adds it;
    the shrink's programs run first in this launch where its tile allows, the expand in a launch after it."""
    return _launch(x, w, bias, w.shape[0], 0, False, config, lora)


def gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for the merged gate_up [2I, K] (gate rows first, as
    MergedColumnParallelLinear lays them out) -> [M, I]: ops.silu_mul(ops.linear(x, gate_up, bias)) in one launch."""
    assert gate_up.shape[0] % 2 == 0, gate_up.shape
    inter = gate_up.shape[0] // 2
    return _launch(x, gate_up, bias, inter, inter, True, config)


_INTERPRETED = not isinstance(_gemv_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
