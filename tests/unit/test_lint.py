"""The tree passes `python -m ruff check .` (configuration: ruff.toml at the repository root; ruff is pinned in
requirements.txt), so CI's test command lints too; and no comment of the project's source quotes a speed ratio."""
from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt pins it)")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"python -m ruff check . found problems:\n{run.stdout}{run.stderr}"


# "Code says why, results say how much" (docs/performance.md, "Choices in the code"): a speed ratio such as `1.23x`
# in a comment of the project's source is a run story; its numbers belong in benchmarks/results or the docs.
SOURCE_DIRS = ("allspark_server", "allspark_client", "native")
RATIO = re.compile(r"\b\d+(\.\d+)?x\b")
PY_SUFFIXES = (".py", ".pyi")
C_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every `#` comment, found by Python's own tokenizer (so not a `#` inside a string)."""
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT]


def c_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every line of `//` and `/* */` comments, skipping string and character literals."""
    out, i, line, n = [], 0, 1, len(text)
    while i < n:
        if text[i] == "\n":
            line, i = line + 1, i + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i:end]))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out += [(line + k, part) for k, part in enumerate(text[i:end].split("\n"))]
            line, i = line + text.count("\n", i, end), end
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] not in (text[i], "\n"):
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def source_files() -> list[str]:
    """The project's Python and C++ source under SOURCE_DIRS, generated protobuf modules (*_pb2*) left out."""
    found = []
    for top in SOURCE_DIRS:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.join(folder, f) for f in sorted(files)
                      if f.endswith(PY_SUFFIXES + C_SUFFIXES) and "_pb2" not in f]
    return found


def ratio_comments(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    comments = python_comments(text) if path.endswith(PY_SUFFIXES) else c_comments(text)
    rel = os.path.relpath(path, ROOT)
    return [f"{rel}:{line}: {comment.strip()}" for line, comment in comments if RATIO.search(comment)]


def test_comment_parsers_find_ratios_only_in_comments():
    py = 's = "1.5x"  # 2x faster\nt = 0x1F  # 0x1F, 4x4 tiles, fp16x2\n'
    assert [c for _, c in python_comments(py) if RATIO.search(c)] == ["# 2x faster"]
    cpp = 'auto s = "// 3x"; char c = \'"\';  // 1.25x\n/* a\n   0.9x */ int x = 0x10;  // 8x8\n'
    assert [(ln, c.strip()) for ln, c in c_comments(cpp) if RATIO.search(c)] == [(1, "// 1.25x"), (3, "0.9x */")]


def test_no_speed_ratios_in_source_comments():
    files = source_files()
    assert any(f.endswith(".cpp") for f in files) and any(f.endswith(".py") for f in files)
    found = [hit for path in files for hit in ratio_comments(path)]
    assert not found, ("speed ratios in comments (say why in the code; put the numbers in benchmarks/results or "
                       "docs/performance.md):\n" + "\n".join(found))


# modules small enough to read in one sitting: the package, the client and the benchmark harness (tests may hold
# longer tables of cases); generated gRPC stubs aside
MAX_MODULE_LINES = 400


def test_no_module_over_400_lines():
    long, scanned = [], 0
    for folder in ("allspark_server", "allspark_client", "benchmarks"):
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "_proto")]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(base, name)
                    with open(path) as f:
                        lines = sum(1 for _ in f)
                    scanned += 1
                    if lines > MAX_MODULE_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
    assert scanned > 100, scanned
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(long)
