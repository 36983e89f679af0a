"""The subprocess of tests/unit/test_docs_commands.py: runs each of our own command lines of the docs until its argparse
parser has parsed the exact argv (then stops it), tries the allspark imports of the ```python blocks, and lists
the registered pytest markers. `python tests/docs_probe.py --probe IN OUT`: IN names the probes, OUT gets the
answers (JSON)."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import runpy
import sys

from docs_commands import ROOT, Probe


# ---- the subprocess: parsers and markers -------------------------------------------------------------------------
class _Parsed(BaseException):
    """Raised right after a parser has parsed the argv: nothing of the command runs. A BaseException, so a
    script's own `except Exception` does not swallow it."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def _extra_checks(probe: Probe, namespace) -> None:
    """Checks a CLI makes on its parsed options before anything runs (they raise SystemExit with a message)."""
    if probe.target in ("allspark_client.launch.launcher:main", "allspark_client.launch.launcher"):
        from allspark_client.launch.options import check_multi_host
        check_multi_host(namespace)


def _avx2_caps() -> dict:
    """benchmarks/common.py's AVX2_CAPS: with them in the environment a script's `--as-avx2` finds itself restarted
    already (common.as_avx2_if_asked) and goes on to its parser here, instead of replacing this process with a run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import AVX2_CAPS
    finally:
        sys.path.pop(0)
    return AVX2_CAPS


def run_probe(probe: Probe) -> str | None:
    """None when the command line's parser accepts its argv; otherwise what went wrong."""
    original = argparse.ArgumentParser.parse_args

    def intercept(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    if "--as-avx2" in probe.args:
        os.environ.update(_avx2_caps())
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


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    probe_main(sys.argv[2], sys.argv[3])
