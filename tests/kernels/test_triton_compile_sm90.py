"""The decode GEMV, LoRA, W8A8, quantized-weight and attention Triton kernels compiled for a Hopper GPU (sm_90)
without one (tests/sm90_compile.py, in a process of its own: kernels decorated under TRITON_INTERPRET=1, as other
tests here make them, cannot be compiled). The interpreter (test_triton_quant.py) checks the values; this catches
what only the compiler rejects (return types that differ between branches, fp8 casts), so that a GPU run does not
find it first."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# not imported here: Triton read before another module sets TRITON_INTERPRET=1 would leave that module's kernels
# compiled, which a CPU cannot run
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quantized_weight_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(TESTS, "sm90_compile.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == 18 and all(line.startswith("ok ") for line in lines), \
        run.stdout + run.stderr[-3000:]
