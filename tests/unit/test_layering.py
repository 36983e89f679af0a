"""Imports run one way: every import inside allspark_server (function-level ones included) goes from a package to one
listed below it in LAYERS, never up; allspark_client imports neither torch nor allspark_server; benchmarks/ and the
client have no import circles. Read from the source with ast, nothing is imported."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# allspark_server's packages (and top-level modules) from the bottom up: each may import only those before it
LAYERS = ["build_info", "core", "quant", "compute", "collective", "step", "layers", "models", "loader", "runner",
          "engine", "http", "pool", "__main__", "__init__"]


def python_files(folder: str):
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "_proto")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                yield os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__"), path


def imports(path: str, package: str) -> list[tuple[str, int]]:
    """(module, line) of every import in the file that names `package` or a module under it."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if (node.module == package or node.module.startswith(package + ".")
                    or (package == "benchmarks" and "." not in node.module)):
                # `from a.b import c`: a.b.c where c is a module, else a.b (resolved by the caller)
                out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name == package or a.name.startswith(package + ".")
                    or (package == "benchmarks" and "." not in a.name)]   # a script's neighbour, by bare name
    return out


def layer_of(module: str) -> str:
    """The LAYERS entry of a module path (a name imported from the package itself counts as its __init__)."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1][:1].isupper()):
        return "__init__"
    return parts[1]


def test_server_imports_run_down_the_layers():
    up = []
    for module, path in python_files("allspark_server"):
        here = layer_of(module)
        assert here in LAYERS, f"{module}: its package {here!r} has no place in LAYERS"
        for target, line in imports(path, "allspark_server"):
            there = layer_of(target)
            if there in ("_native", here) or (there == "__init__" and here == "http"):
                continue   # the extension, the same package, or http/ taking the public API from the package
            assert there in LAYERS, f"{module}:{line} imports {target}, a package with no place in LAYERS"
            if LAYERS.index(there) > LAYERS.index(here):
                up.append(f"{module}:{line} imports {target}")
    assert not up, "imports that run back up:\n" + "\n".join(up)


def test_client_imports_neither_torch_nor_the_server():
    bad = [f"{module}:{line} imports {target}" for module, path in python_files("allspark_client")
           for package in ("torch", "allspark_server") for target, line in imports(path, package)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["allspark_server", "allspark_client", "benchmarks"])
def test_no_import_circles(folder):
    package = folder
    modules = dict(python_files(folder))
    graph = defaultdict(set)
    for module, path in modules.items():
        for target, _ in imports(path, package):
            if package == "benchmarks" and not target.startswith("benchmarks."):
                target = "benchmarks." + target        # scripts import their neighbours by bare name
            if target.split(".")[1].startswith("_"):
                continue                               # the native extension, the generated gRPC stubs
            while target and target not in modules:    # `from a.b import name`: the module is a.b
                target = target.rpartition(".")[0]
            if package == "benchmarks" and target == "benchmarks":
                continue                               # not a benchmark module (a library imported by bare name)
            if target and target != module:
                graph[module].add(target)
    state, cycle = {}, []

    def visit(m, trail):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle.append(" -> ".join(trail[trail.index(n):] + [n]))
            elif n not in state:
                visit(n, trail + [n])
        state[m] = "done"
    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert not cycle, "import circles:\n" + "\n".join(cycle)
