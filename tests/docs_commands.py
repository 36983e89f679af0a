"""The commands of README.md and docs/*.md and their static checks (nothing of ours imported): reading the fenced
blocks, splitting a line into simple commands, what the repository declares (console scripts, allspark-serve's
routes, top-level entries), and the checks of paths, pip, curl and python invocations. The rules are in
tests/unit/test_docs_commands.py's docstring; our parsers run in tests/docs_probe.py."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

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
    """The simple commands of one line, by the rules in tests/unit/test_docs_commands.py's docstring."""
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
