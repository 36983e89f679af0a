"""Imports run one way: every import inside allspark_server (function-level ones included) goes from a package to one
listed below it in LAYERS, never up; allspark_client imports neither torch nor allspark_server; benchmarks/ and the
client have no import circles. And the device is asked about only inside compute/: elsewhere code asks the rank's
DeviceKind (compute/device_kind.py) by a trait's name, never the device's type. Read from the source with ast,
nothing is imported."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# allspark_server's packages (and top-level modules) from the bottom up: each may import only those before it
LAYERS = ["build_info", "core", "quant", "compute", "collective", "step", "layers", "models", "lora", "loader",
          "vision", "runner", "speculative", "engine", "http", "pool", "__main__", "__init__"]


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


# A rank's device is chosen once, inside compute/ (compute/device_choice.py), into a DeviceKind whose traits and calls
# say what differs between devices and why (compute/device_kind.py, compute/cuda/cuda_device.py). Outside compute/
# no module asks a device's type, a tensor's is_cuda / is_cpu, torch.cuda, or compares a device (or its name) to
# "cpu" / "cuda". Where only a tensor is at hand, compute.device_kind.in_host_memory says where it lives.
DEVICE_QUESTIONS_LIVE_IN = "allspark_server.compute"
# module -> why it may ask the device itself (none: keep it that way)
DEVICE_CHECKS_ALLOWED: dict[str, str] = {}
DEVICE_NAMES = {"cpu", "cuda"}


def _names_device(node: ast.AST) -> bool:
    """`device`, `x.device`, `torch.device(...)` or a name with "device" in it."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return "device" in node.id.lower()
    return isinstance(node, ast.Attribute) and "device" in node.attr.lower()


def _device_name(node: ast.AST) -> bool:
    """A string constant "cpu" / "cuda" (any case), or a tuple, list or set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_device_name(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in DEVICE_NAMES


def device_checks(source: str, path: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) of every place `source` asks which device it runs on."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute):
            if node.attr == "type" and _names_device(node.value):
                found.append((node.lineno, "a device's .type"))
            elif node.attr in ("is_cuda", "is_cpu"):
                found.append((node.lineno, f".{node.attr}"))
            elif node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append((node.lineno, "torch.cuda"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("torch.cuda")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("torch.cuda") or (node.module == "torch" and
                                                          any(a.name == "cuda" for a in node.names)):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Compare) and any(_device_name(x) for x in [node.left] + node.comparators):
            found.append((node.lineno, "a comparison with a device's name"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args and _device_name(node.args[0])):
            found.append((node.lineno, f".{node.func.attr}() of a device's name"))
    return found


def test_device_checks_are_found():
    src = """import torch
from torch import cuda
if x.device.type == "cpu" or t.is_cuda or device.type != 'cuda' or torch.device(d).type in ("cpu",): pass
torch.cuda.synchronize()
ok = str(dev).startswith("cuda") or unit == "CPU"
fine = t.to("cpu"), torch.device("cpu"), field.type == ARRAY, in_host_memory(t), kind.defers_delivery
"""
    found = device_checks(src)
    assert sorted({line for line, _ in found}) == [2, 3, 4, 5]      # line 6 asks nothing of a device
    assert len(found) == 11    # line 3: three .type, three comparisons, .is_cuda; line 5: startswith, == "CPU"


def test_device_is_asked_only_inside_compute():
    found = []
    for module, path in python_files("allspark_server"):
        if module == DEVICE_QUESTIONS_LIVE_IN or module.startswith(DEVICE_QUESTIONS_LIVE_IN + "."):
            continue
        if module in DEVICE_CHECKS_ALLOWED:
            continue
        found += [f"{module}:{line}: {what}" for line, what in device_checks(open(path).read(), path)]
    assert not found, ("device checks outside compute/ (ask the rank's DeviceKind by a trait's name, or "
                       "compute.device_kind.in_host_memory for a tensor):\n" + "\n".join(found))
    assert all(reason for reason in DEVICE_CHECKS_ALLOWED.values()), "every allowed module says why"
