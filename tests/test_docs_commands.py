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
runs. `python tests/test_docs_commands.py --probe IN OUT` is the subprocess's entry point.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell"}
CONSOLE_BLOCKS = {"console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
# tools the docs may call that are not ours; they are accepted by name (a CI machine may lack them)
EXTERNAL_PROGRAMS = {"mpirun", "numactl", "systemctl", "curl", "cp", "mkdir", "bash", "sh", "apt-get", "nvidia-smi"}
PYTHONS = {"python", "python3"}
PIPS = {"pip", "pip3"}
# scripts whose command lines are ours: checked against their parsers
OUR_SCRIPT_DIRS = ("examples", "benchmarks")
SERVE_ADDRESSES = {("127.0.0.1", 8000), ("localhost", 8000)}
README_MAX_LINES = 250


@dataclass
class Command:
    """One simple command of a doc: where it is, the line it came from and its words."""
    doc: str
    line: int
    text: str
    argv: list[str]
    problems: list[str] = field(default_factory=list)   # found while splitting the line

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


# ---- reading the docs -------------------------------------------------------------------------------------------
def fenced_blocks(path: Path):
    """(language, [(line number, text)]) of each fenced block of a markdown file."""
    lang, body = None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and lang is None:
            lang, body = fence.group(1).lower(), []
        elif fence and not fence.group(1):
            yield lang, body
            lang = None
        elif lang is not None:
            body.append((number, line))


def command_lines(lang: str, body):
    """(line number, command text) of a shell or console block, continuation lines joined."""
    lines, pending, start = [], None, 0
    for number, text in body:
        if pending is None:
            if lang in CONSOLE_BLOCKS:
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            pending, start = "", number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + text))
        pending = None
    if pending is not None:
        lines.append((start, pending))
    return lines


def split_commands(doc: str, number: int, text: str) -> list[Command]:
    """The simple commands of one line, by the rules in this module's docstring."""
    problems = []
    if "$(" in text or "`" in text:
        problems.append("command substitution ($(...) or backquotes) cannot be checked; write the command out")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as e:          # an unclosed quote
        return [Command(doc, number, text, [], [f"cannot split the line: {e}"])]
    commands, argv = [], []
    for word in words:
        if word in SEPARATORS:
            commands.append(argv)
            argv = []
        elif word and set(word) <= set("();<>|&"):
            problems.append(f"shell syntax {word!r} (redirection or subshell) is not allowed in docs commands")
        else:
            argv.append(word)
    commands.append(argv)
    out = []
    for argv in commands:
        while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] == "time"):
            argv = argv[1:]
        if argv or problems:
            out.append(Command(doc, number, text, argv, list(problems)))
    return out


def collect_commands(files=DOC_FILES) -> list[Command]:
    commands = []
    for path in files:
        doc = str(path.relative_to(ROOT))
        for lang, body in fenced_blocks(path):
            if lang in SHELL_BLOCKS or lang in CONSOLE_BLOCKS:
                for number, text in command_lines(lang, body):
                    commands.extend(split_commands(doc, number, text))
    return commands


def python_blocks(files=DOC_FILES):
    """(where, code) of each ```python block."""
    for path in files:
        for lang, body in fenced_blocks(path):
            if lang == "python" and body:
                yield f"{path.relative_to(ROOT)}:{body[0][0]}", "\n".join(text for _, text in body)


def allspark_imports(code: str) -> list[str]:
    """"module:name" of every `from allspark_... import name` in a block of code."""
    return [f"{node.module}:{alias.name}" for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("allspark_")
            for alias in node.names]


# ---- what the repository declares --------------------------------------------------------------------------------
def console_scripts() -> dict[str, str]:
    """{script name: "module:function"} from setup.py's console_scripts."""
    text = (ROOT / "setup.py").read_text()
    return {name: f"{module}:{func}"
            for name, module, func in re.findall(r"""["']([\w-]+)\s*=\s*([\w.]+):(\w+)["']""", text)}


def serve_routes() -> set[tuple[str, str]]:
    """(method, path) of allspark-serve's routes, read from its app module's decorators."""
    text = (ROOT / "allspark_server" / "http" / "app.py").read_text()
    return {(m.upper(), p) for m, p in re.findall(r"""@app\.(get|post)\(\s*["']([^"']+)["']""", text)}


TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.name != ".git"}


def repo_paths(argv: list[str]) -> list[str]:
    """The arguments that name something inside the repository (relative, first component a top-level entry)."""
    out = []
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value.startswith("-") or value.startswith("/") or not value:
            continue
        first = value.split("/", 1)[0]
        if first in TOP_LEVEL and ("/" in value or value == first):
            out.append(value)
    return out


# ---- static checks (no imports) ----------------------------------------------------------------------------------
@dataclass
class Probe:
    """A command line of ours to run up to its parser: kind "entry" (module:function), "module" or "script"."""
    kind: str
    target: str
    args: list[str]
    prog: str


def python_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """`python -m MOD ARGS` -> ("module", MOD, ARGS); `python FILE ARGS` -> ("script", FILE, ARGS); else None."""
    if len(argv) >= 3 and argv[1] == "-m":
        return "module", argv[2], argv[3:]
    if len(argv) >= 2 and not argv[1].startswith("-"):
        return "script", argv[1], argv[2:]
    return None


def pytest_markers(args: list[str]) -> list[str]:
    """The marker names of every `-m EXPR` (or `-mEXPR`) among pytest's arguments."""
    names = []
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            expr = args[i + 1]
        elif arg.startswith("-m") and len(arg) > 2:
            expr = arg[2:]
        else:
            continue
        names += [word for word in re.findall(r"[A-Za-z_]\w*", expr) if word not in ("and", "or", "not")]
    return names


PIP_PATH_FLAGS = ("-r", "--requirement", "-e", "--editable")


def check_pip(argv: list[str]) -> list[str]:
    """`pip install`: the values of -r / -e and the local paths (., ./x) exist in the repository."""
    if len(argv) < 2 or argv[1] != "install":
        return [f"only `pip install` is used in the docs, got {shlex.join(argv)!r}"]
    args, problems = argv[2:], []
    for i, arg in enumerate(args):
        names_path = (i > 0 and args[i - 1] in PIP_PATH_FLAGS) or arg in (".", "..") or arg.startswith("./")
        if arg in PIP_PATH_FLAGS and i + 1 == len(args):
            problems.append(f"{arg} needs a value")
        elif names_path and not (ROOT / arg).exists():
            problems.append(f"pip install names {arg!r}, which does not exist in the repository")
    return problems


def check_curl(argv: list[str], routes: set[tuple[str, str]]) -> list[str]:
    problems, body, urls = [], None, []
    args = argv[1:]
    for i, arg in enumerate(args):
        if arg in ("-d", "--data", "--data-raw", "--data-binary") and i + 1 < len(args):
            body = args[i + 1]
        elif arg.startswith(("http://", "https://")):
            urls.append(arg)
    if body is not None:
        try:
            json.loads(body)
        except ValueError as e:
            problems.append(f"curl's -d body is not valid JSON: {e}")
    for url in urls:
        parsed = urlparse(url)
        if (parsed.hostname, parsed.port) in SERVE_ADDRESSES:
            method = "POST" if body is not None else "GET"
            if (method, parsed.path) not in routes:
                problems.append(f"{method} {parsed.path} is not a route of allspark-serve "
                                f"(routes: {sorted(routes)})")
    return problems


def static_check(cmd: Command, scripts: dict[str, str], routes: set[tuple[str, str]]
                 ) -> tuple[list[str], Probe | None, list[str]]:
    """(problems, the probe to run for our own command lines, markers to look up)."""
    problems = list(cmd.problems)
    argv = cmd.argv
    if not argv:
        return problems or ["empty command"], None, []
    prog = argv[0]
    for path in repo_paths(argv):
        if not (ROOT / path).exists():
            problems.append(f"{path!r} does not exist in the repository")
    probe, markers = None, []
    if prog in scripts:
        probe = Probe("entry", scripts[prog], argv[1:], prog)
    elif prog in PYTHONS:
        target = python_target(argv)
        if target is None:
            problems.append(f"unsupported python invocation {shlex.join(argv)!r} (use `python -m MODULE` or "
                            f"`python FILE`)")
        elif target[0] == "module":
            _, module, args = target
            if module.split(".")[0] in ("allspark_server", "allspark_client"):
                probe = Probe("module", module, args, f"python -m {module}")
            elif importlib.util.find_spec(module) is None:
                problems.append(f"python -m {module}: no module named {module!r}")
            if module == "pytest":
                markers = pytest_markers(args)
        else:
            _, script, args = target
            path = ROOT / script
            if not path.is_file():
                problems.append(f"python {script}: no such file in the repository")
            elif script.split("/")[0] in OUR_SCRIPT_DIRS:
                probe = Probe("script", script, args, script)
            else:
                try:
                    compile(path.read_text(), str(path), "exec")
                except SyntaxError as e:
                    problems.append(f"python {script} does not compile: {e}")
    elif prog in PIPS:
        problems += check_pip(argv)
    elif prog == "curl":
        problems += check_curl(argv, routes)
    elif prog in EXTERNAL_PROGRAMS:
        pass
    elif prog.split("/")[0] in TOP_LEVEL or prog.startswith("./"):
        path = ROOT / prog
        if not (path.is_file() and os.access(path, os.X_OK)):
            problems.append(f"{prog} is not an executable file of the repository")
    else:
        problems.append(f"program {prog!r} does not resolve: not a console script of setup.py "
                        f"({', '.join(sorted(scripts))}), python, pip, a file of the repository, or one of "
                        f"{sorted(EXTERNAL_PROGRAMS)}")
    return problems, probe, markers


# ---- the subprocess: parsers and markers -------------------------------------------------------------------------
class _Parsed(BaseException):
    """Raised right after a parser has parsed the argv: nothing of the command runs. A BaseException, so a
    script's own `except Exception` does not swallow it."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def _extra_checks(probe: Probe, namespace) -> None:
    """Checks a CLI makes on its parsed options before anything runs (they raise SystemExit with a message)."""
    if probe.target in ("allspark_client.launcher:main", "allspark_client.launcher"):
        from allspark_client.launcher import check_multi_host
        check_multi_host(namespace)


def run_probe(probe: Probe) -> str | None:
    """None when the command line's parser accepts its argv; otherwise what went wrong."""
    original = argparse.ArgumentParser.parse_args

    def intercept(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    err = io.StringIO()
    argparse.ArgumentParser.parse_args = intercept
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if probe.kind == "entry":
                module, func = probe.target.split(":")
                sys.argv = [probe.prog, *probe.args]
                getattr(importlib.import_module(module), func)()
            elif probe.kind == "module":
                sys.argv = [probe.prog, *probe.args]
                runpy.run_module(probe.target, run_name="__main__", alter_sys=True)
            else:
                path = str(ROOT / probe.target)
                sys.argv = [path, *probe.args]
                sys.path.insert(0, os.path.dirname(path))      # as `python FILE` does
                runpy.run_path(path, run_name="__main__")
        return "it ran to the end without reaching an argparse parser"
    except _Parsed as parsed:
        try:
            with contextlib.redirect_stderr(err):
                _extra_checks(probe, parsed.namespace)
        except SystemExit as e:
            return f"refused after parsing: {e.code}"
        return None
    except SystemExit as e:
        if e.code in (0, None):           # --help and the like
            return None
        return f"the parser refused the options (exit {e.code}): {err.getvalue().strip() or e.code}"
    except Exception as e:   # an import that fails, a script that breaks before its parser
        return f"failed before its parser: {e!r}"
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def registered_markers() -> set[str]:
    """The markers `pytest --markers` lists from the repository root (tests/conftest.py registers the tiers)."""
    import pytest
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pytest.main(["--markers", "-p", "no:cacheprovider", "-q"])
    return set(re.findall(r"^@pytest\.mark\.(\w+)", out.getvalue(), re.M))


def import_problem(target: str) -> str | None:
    """None when `from module import name` works ("module:name")."""
    module, name = target.split(":")
    try:
        getattr(importlib.import_module(module), name)
    except Exception as e:
        return f"from {module} import {name}: {e!r}"
    return None


def probe_main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        request = json.load(f)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    results = {"parsers": [run_probe(Probe(**p)) for p in request["probes"]],
               "imports": {target: import_problem(target) for target in request["imports"]}}
    if request["markers"]:
        results["markers"] = sorted(registered_markers())
    with open(out_path, "w") as f:
        json.dump(results, f)


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
        run = subprocess.run([sys.executable, __file__, "--probe", request, answer], cwd=ROOT, env=env,
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

if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    probe_main(sys.argv[2], sys.argv[3])
