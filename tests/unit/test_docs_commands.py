"""Every shell command in README.md and docs/*.md runs as written, as far as a machine without GPUs, pools or long
runs can tell.

Which lines are commands:
- In fenced blocks opened with ```bash, ```sh or ```shell: every line, after joining lines that end in a
  backslash. Blank lines and comment lines are skipped; a trailing `# comment` is dropped.
- In fenced blocks opened with ```console: only lines that start with `$ ` (the other lines are output).
- A line may chain simple commands with `&&`, `||`, `;` or `|`, or end with `&`; each simple command is checked.
  Leading `NAME=value` assignments and the `time` keyword are skipped. Redirections, subshells, `$(...)` and
  backquotes are refused: commands in the docs stay simple enough to copy and to check.

What each simple command must satisfy:
- Its program resolves: an allspark console script declared in setup.py, python, pip, one of EXTERNAL_PROGRAMS,
  or a file of this repository.
- Every relative path among its arguments whose first component is a top-level entry of the repository
  (`launch/...`, `tests/...`, `requirements.txt`) exists. Docs therefore name no files that a command would
  create inside the repository.
- `python -m MODULE`: the module can be found. `python FILE`: the file exists and compiles.
- Our own command lines (the console scripts, `python -m allspark_server...` / `allspark_client...`,
  `python examples/*.py`, `python benchmarks/*.py`) are run, in one subprocess, until their argparse parser has
  parsed the exact argv, and stopped there: the parser must accept every option. allspark-launch's multi-host
  checks run on the result too.
- `python -m pytest -m EXPR`: every marker named in EXPR is registered (what `pytest --markers` lists).
- `pip install`: the files of `-r` and the local paths (`-e .`, `.`) exist.
- `curl`: a `-d` body is valid JSON, and a URL on the default `allspark-serve` address names one of its routes.

Also: ```python blocks parse, README.md stays within 250 lines, and the README's test command is the one .ci/run
runs. The reading of the docs and the static checks are in tests/docs_commands.py; the parsers run in a
subprocess, tests/docs_probe.py (`python tests/docs_probe.py --probe IN OUT`).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
from docs_commands import (
    README_MAX_LINES,
    ROOT,
    SHELL_BLOCKS,
    Command,
    allspark_imports,
    collect_commands,
    console_scripts,
    fenced_blocks,
    python_blocks,
    serve_routes,
    static_check,
)

PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs_probe.py")


# ---- the tests ---------------------------------------------------------------------------------------------------
COMMANDS = collect_commands()


PYTHON_BLOCKS = list(python_blocks())


@dataclass
class Checked:
    commands: dict[int, list[str]]        # id(command) -> its problems
    imports: dict[str, str | None]       # "module:name" -> why it cannot be imported (None: it can)


@pytest.fixture(scope="module")
def checked() -> Checked:
    """The static checks here; the parsers, the imports of the python blocks and the markers in one subprocess."""
    scripts, routes = console_scripts(), serve_routes()
    problems, probes, wanted_markers = {}, [], {}
    for cmd in COMMANDS:
        found, probe, markers = static_check(cmd, scripts, routes)
        problems[id(cmd)] = found
        if probe is not None:
            probes.append((cmd, probe))
        if markers:
            wanted_markers[id(cmd)] = markers
    imports = set()
    for _, code in PYTHON_BLOCKS:
        with contextlib.suppress(SyntaxError):       # test_python_block reports it
            imports.update(allspark_imports(code))
    with tempfile.TemporaryDirectory() as tmp:
        request, answer = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(request, "w") as f:
            json.dump({"probes": [p.__dict__ for _, p in probes], "imports": sorted(imports),
                       "markers": bool(wanted_markers)}, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, PROBE_SCRIPT, "--probe", request, answer], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and os.path.exists(answer), (
            f"the probe subprocess failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        with open(answer) as f:
            results = json.load(f)
    for (cmd, probe), error in zip(probes, results["parsers"]):
        if error:
            problems[id(cmd)].append(f"{probe.prog}: {error}")
    registered = set(results.get("markers", []))
    for key, markers in wanted_markers.items():
        problems[key] += [f"pytest marker {m!r} is not registered (registered: {sorted(registered)})"
                          for m in markers if m not in registered]
    return Checked(problems, results["imports"])


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where}:{(c.argv or ['?'])[0]}" for c in COMMANDS])
def test_command_runs_as_written(cmd: Command, checked: Checked):
    problems = checked.commands[id(cmd)]
    assert not problems, f"{cmd.where}: {cmd.text}\n  " + "\n  ".join(problems)


def test_the_docs_have_commands():
    """The collector sees the README's quick start and test command (a broken reader checks nothing)."""
    readme = [c for c in COMMANDS if c.doc == "README.md"]
    assert any(c.argv[:2] == ["python", "examples/quickstart.py"] for c in readme), readme
    assert any(c.argv[:3] == ["python", "-m", "pytest"] for c in readme), readme


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and "pytest" in line]
    assert len(ci) == 1, ci
    readme_lines = {text for lang, body in fenced_blocks(ROOT / "README.md") if lang in SHELL_BLOCKS
                    for _, text in body}
    assert ci[0].strip() in readme_lines, f"README.md's test command differs from .ci/run's: {ci[0]!r}"


def test_readme_length():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}"


@pytest.mark.parametrize("where,code", PYTHON_BLOCKS, ids=[where for where, _ in PYTHON_BLOCKS])
def test_python_block(where: str, code: str, checked: Checked):
    """A ```python block parses, and the allspark names it imports exist."""
    try:
        names = allspark_imports(code)
    except SyntaxError as e:
        pytest.fail(f"{where}: the python block does not parse: {e}")
    problems = [checked.imports[name] for name in names if checked.imports.get(name)]
    assert not problems, f"{where}: " + "; ".join(problems)


def test_a_script_that_restarts_itself_under_the_avx2_caps_is_probed_in_place(tmp_path):
    """`--as-avx2` makes a benchmark exec itself again at import (benchmarks/common.py): probed as written, the probe
    process would be replaced by a run of it and answer nothing. The probe sets the caps first; the parser is
    reached. (Were it not, the small run asked for here would take the probe's place and this test would fail.)"""
    probe = {"kind": "script", "target": "benchmarks/prefill_attention_micro.py", "prog": "python",
             "args": ["--as-avx2", "--lengths", "16", "--dtypes", "float32", "--rounds", "1", "--reps", "1",
                      "--json", str(tmp_path / "micro.json")]}
    request, answer = tmp_path / "in.json", tmp_path / "out.json"
    request.write_text(json.dumps({"probes": [probe], "imports": [], "markers": False}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, PROBE_SCRIPT, "--probe", str(request), str(answer)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and answer.exists(), (run.returncode, run.stderr[-2000:])
    assert json.loads(answer.read_text())["parsers"] == [None]
    assert not (tmp_path / "micro.json").exists()
