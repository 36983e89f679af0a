"""Alone-rows mode: while it is on, each row of a decode step is computed by the kernels a one-row step takes, so
that it comes out as it would alone. A speculative verify chunk (k + 1 rows of one sequence) runs in it
(runner/model_runner.py). On a CPU every row count takes the native GEMV (ops.native_rows, ops.linear, and the
decode stack's `all_rows_native`). On a GPU the dense and quantized GEMVs run their one-row kernel with a program
per row and tile (all rows in one launch, each computed as the one-row launch computes it), and the decode
attention splits the keys as it does for one sequence. Read when kernels are chosen, also while a CUDA graph is
captured: the verify graphs are captured in it (runner/cuda_graphs.py)."""
from __future__ import annotations

import contextlib

_alone = False


def alone() -> bool:
    return _alone


@contextlib.contextmanager
def alone_rows(on: bool = True):
    global _alone
    before, _alone = _alone, bool(on)
    try:
        yield
    finally:
        _alone = before
