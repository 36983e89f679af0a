"""Alone-rows mode: while it is on, each row of a decode step is computed by the kernels a one-row step takes, so
that it comes out as it would alone. A speculative verify chunk (k + 1 rows of one sequence) runs in it
(runner/model_runner.py). On a CPU every row count takes the native GEMV (ops.native_rows, ops.linear, and the
decode stack's `all_rows_native`). On a GPU the dense and quantized GEMVs run their one-row kernel with a program
per row and tile (all rows in one launch, each computed as the one-row launch computes it), and the decode
attention splits the keys as it does for one sequence. Read when kernels are chosen, also while a CUDA graph is
captured: the verify graphs are captured in it (runner/cuda_graphs.py).

Invariant-rows mode, on a GPU: dense bf16 / fp16 linears of up to 16 rows take a tensor-core GEMV whose rows never
depend on the others (gemv_kernels._rows_dot_kernel), so a verify chunk's rows are what they are alone from one
weight read. A speculating model's runner keeps it on around all of its steps and graph captures
(runner/model_runner.py), so that its one-row steps take the same kernel; so does ALLSPARK_BATCH_INVARIANT, for every
model."""
from __future__ import annotations

import contextlib

_alone = False
_invariant = False


def alone() -> bool:
    return _alone


def invariant() -> bool:
    return _invariant


@contextlib.contextmanager
def _switched(name: str, on: bool):
    before = globals()[name]
    globals()[name] = bool(on)
    try:
        yield
    finally:
        globals()[name] = before


def alone_rows(on: bool = True):
    """Alone-rows mode on (or off) inside the block."""
    return _switched("_alone", on)


def invariant_rows(on: bool = True):
    """Invariant-rows mode on (or off) inside the block."""
    return _switched("_invariant", on)
