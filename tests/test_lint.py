"""The tree passes `python -m ruff check .` (configuration: ruff.toml at the repository root; ruff is pinned in
requirements.txt), so CI's test command lints too."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt pins it)")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"python -m ruff check . found problems:\n{run.stdout}{run.stderr}"
