"""The benchmark smoke tests' pieces (tests/models/test_benchmark_smoke.py, test_benchmark_scripts.py): where the
scripts are, the GPU skip, whether the llama.cpp peer can run, reading a script's JSON and the sanity check of its
numbers. Importing it turns Triton's interpreter on where there is no GPU; the `bench` fixture that runs a script
in this process is in tests/conftest.py."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from pool_helpers import REPO

BENCH = os.path.join(REPO, "benchmarks")
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="no CUDA device")


def llamacpp_missing() -> str | None:
    sys.path.insert(0, BENCH)
    import llamacpp_peer
    return llamacpp_peer.missing()


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)
