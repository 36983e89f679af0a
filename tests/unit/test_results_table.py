"""benchmarks/RESULTS.md is what benchmarks/results_table.py makes of benchmarks/results/ (regenerate it whenever a
result file changes), it names every file there, and the generator gives the same text on every run."""
from __future__ import annotations

import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import results_table  # noqa: E402


def test_results_md_is_up_to_date():
    with open(results_table.RESULTS_MD) as f:
        current = f.read()
    assert current == results_table.render(), (
        "benchmarks/RESULTS.md is stale: run `python benchmarks/results_table.py` and commit it")


def test_every_result_file_appears():
    text = results_table.render()
    names = sorted(os.listdir(results_table.RESULTS_DIR))
    files = [n for n in names if os.path.isfile(os.path.join(results_table.RESULTS_DIR, n))]
    assert files, "benchmarks/results/ is empty"
    missing = [n for n in files if f"`results/{n}`" not in text]
    assert not missing, missing


def test_render_is_deterministic_and_sees_a_changed_file(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(results_table.RESULTS_DIR, copy, ignore=shutil.ignore_patterns("quick"))
    first = results_table.render(str(copy))
    assert first == results_table.render(str(copy))
    name = sorted(n for n in os.listdir(copy) if n.endswith(".json"))[0]
    with open(copy / name, "a") as f:      # any byte of a result file changes the text (its digest)
        f.write("\n")
    assert results_table.render(str(copy)) != first


def test_a_new_measure_gets_a_table(tmp_path):
    (tmp_path / "made-up-measure-h100.json").write_text('{"speedup": 1.5, "note": "x"}')
    text = results_table.render(str(tmp_path))
    assert "`results/made-up-measure-h100.json`" in text and "| speedup | 1.500 |" in text
