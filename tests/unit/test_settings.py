"""allspark_client/settings.py: every ALLSPARK_* variable is declared there, docs/settings.md is generated from
the declarations, values are checked (errors name the variable and the value), read once and refreshed by
override() / reload()."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from allspark_client import settings
from allspark_client.types import AsStatus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# where a variable's name may appear: code, scripts, units and docs (result files and generated stubs aside)
SCANNED = (".py", ".md", ".sh", ".service", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".cpp", ".h", ".proto")
SKIPPED_DIRS = {".git", "build", "dist", "__pycache__", ".venv", ".cache", ".pytest_cache", "_proto", "node_modules"}
NAME = re.compile(r"\bALLSPARK_[A-Z][A-Z0-9_]*")

DEFAULTS = {   # the shipped defaults, written out again so that changing one is a visible decision
    "ALLSPARK_TOKEN": None, "ALLSPARK_API_KEY": None, "ALLSPARK_MAX_BODY_MB": 16.0, "ALLSPARK_LOG_LEVEL": "info",
    "ALLSPARK_CPU_ISA": "auto", "ALLSPARK_BATCH_INVARIANT": False, "ALLSPARK_KV_PREFAULT": True,
    "ALLSPARK_MPIRUN": "mpirun", "ALLSPARK_NO_NATIVE": False, "ALLSPARK_MEMORY_BANDWIDTH_GBS": None,
    "ALLSPARK_PROFILE": None,
    "ALLSPARK_OVERLAP": True, "ALLSPARK_CUDA_GRAPHS": True, "ALLSPARK_TRITON_GEMV": True, "ALLSPARK_PDL": True,
    "ALLSPARK_FUSED_DECODE": True, "ALLSPARK_PEER_ALLREDUCE": True, "ALLSPARK_PEER_ALLREDUCE_PROTOCOL": "sentinel",
    "ALLSPARK_GUIDED_MASKS": None,
    "ALLSPARK_RANK_GPU": None, "ALLSPARK_PLACED": False,
    "ALLSPARK_FUZZ_EXAMPLES": 300, "ALLSPARK_SOAK_REQUESTS": 400, "ALLSPARK_FAULT_STREAMS": 8,
}


def tree_files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(SCANNED):
                yield os.path.join(folder, name)


def test_the_docs_are_generated_from_the_declarations():
    with open(os.path.join(ROOT, "docs", "settings.md")) as f:
        assert f.read() == settings.markdown(), \
            "docs/settings.md is stale: python -m allspark_client.settings --markdown > docs/settings.md"


def test_every_allspark_name_in_the_tree_is_declared():
    statuses = {s.name for s in AsStatus}
    seen: dict[str, str] = {}
    for path in tree_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for name in NAME.findall(f.read()):
                if name not in statuses:
                    seen.setdefault(name, os.path.relpath(path, ROOT))
    undeclared = {name: where for name, where in seen.items() if name not in settings.ALL}
    assert not undeclared, f"declare these in allspark_client/settings.py: {undeclared}"
    assert set(settings.ALL) <= set(seen), "every declared variable is used somewhere"


def test_the_packages_read_no_variable_past_the_settings_module():
    raw = re.compile(r"environ(\.get\(|\[)\s*[\"']ALLSPARK_")
    offenders = []
    for package in ("allspark_client", "allspark_server", "benchmarks"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            offenders += [os.path.join(folder, n) for n in files if n.endswith(".py")
                          and raw.search(open(os.path.join(folder, n), encoding="utf-8").read())]
    assert not offenders, f"read these through allspark_client.settings: {offenders}"


def test_declarations_and_defaults():
    assert set(settings.ALL) == set(DEFAULTS)
    for name, setting in settings.ALL.items():
        assert setting.name == name and setting.kind in settings.KINDS and setting.doc
        assert setting.read({}) == DEFAULTS[name] == setting.default, name
        assert setting.read({name: "  "}) == setting.default or setting.type is str, name   # blank: the default
    assert settings.NO_NATIVE.read({"ALLSPARK_NO_NATIVE": "1"}) is True
    assert settings.OVERLAP.read({"ALLSPARK_OVERLAP": "0"}) is False


@pytest.mark.parametrize("allspark,dashinfer,value", [(None, None, False), (None, "ON", True), (None, "OFF", False),
                                                      ("0", "ON", False), ("1", "OFF", True), (None, " ", False)])
def test_profiling_is_allspark_profile_else_dashinfers_as_profile(monkeypatch, allspark, dashinfer, value):
    for name, text in (("ALLSPARK_PROFILE", allspark), ("AS_PROFILE", dashinfer)):
        if text is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, text)
    settings.reload()
    try:
        assert settings.profiling_requested() is value
    finally:
        monkeypatch.undo()
        settings.reload()


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("Yes", True), (" on ", True),
                                        ("0", False), ("FALSE", False), ("no", False), ("off", False)])
def test_bool_spellings(text, value):
    assert settings.PDL.parse(text) is value


def test_values_are_parsed_to_their_types():
    assert settings.RANK_GPU.read({"ALLSPARK_RANK_GPU": " 3"}) == 3
    assert settings.MEMORY_BANDWIDTH_GBS.read({"ALLSPARK_MEMORY_BANDWIDTH_GBS": "812.5"}) == 812.5
    assert settings.GUIDED_MASKS.read({"ALLSPARK_GUIDED_MASKS": "Background"}) == "background"
    assert settings.LOG_LEVEL.read({"ALLSPARK_LOG_LEVEL": "DEBUG"}) == "debug"
    assert settings.TOKEN.read({"ALLSPARK_TOKEN": ""}) == "", "a string keeps an empty value (the rank refuses it)"


@pytest.mark.parametrize("setting,bad", [
    (settings.PDL, "maybe"), (settings.OVERLAP, "2"), (settings.NO_NATIVE, "y"),
    (settings.RANK_GPU, "gpu1"), (settings.RANK_GPU, "-1"), (settings.FUZZ_EXAMPLES, "0"),
    (settings.SOAK_REQUESTS, "1.5"), (settings.MEMORY_BANDWIDTH_GBS, "fast"), (settings.MEMORY_BANDWIDTH_GBS, "0"),
    (settings.GUIDED_MASKS, "sometimes"), (settings.LOG_LEVEL, "loud"),
])
def test_a_bad_value_is_an_error_naming_the_variable_and_the_value(setting, bad):
    with pytest.raises(settings.SettingError) as e:
        setting.read({setting.name: bad})
    assert setting.name in str(e.value) and repr(bad) in str(e.value)


def test_a_value_is_read_once_until_override_or_reload(monkeypatch):
    with settings.override(PDL=None):
        assert settings.PDL.get() is True
        monkeypatch.setenv("ALLSPARK_PDL", "0")
        assert settings.PDL.get() is True, "cached: a later change of os.environ alone is not seen"
        settings.reload()
        assert settings.PDL.get() is False
        with settings.override({"ALLSPARK_PDL": "1"}, FUSED_DECODE=False):
            assert os.environ["ALLSPARK_PDL"] == "1" and os.environ["ALLSPARK_FUSED_DECODE"] == "0"
            assert settings.PDL.get() is True and settings.FUSED_DECODE.get() is False
        assert os.environ["ALLSPARK_PDL"] == "0" and settings.PDL.get() is False, "restored on exit"
    assert "ALLSPARK_PDL" not in os.environ or os.environ["ALLSPARK_PDL"] != "0"
    with pytest.raises(KeyError, match="not a declared"):
        with settings.override(NO_SUCH_THING=1):
            pass
    with pytest.raises(settings.SettingError, match="ALLSPARK_OVERLAP"):
        with settings.override(OVERLAP="sometimes"):
            pass


def test_a_child_process_inherits_an_override():
    code = "from allspark_client import settings; print(settings.OVERLAP.get(), settings.RANK_GPU.get())"
    with settings.override(OVERLAP=False, RANK_GPU=2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False", "2"], out.stderr


def test_the_module_is_torch_free_and_its_command_reports_bad_values():
    code = ("import sys; from allspark_client import settings; "
            "assert not {'torch', 'allspark_server'} & set(m.split('.')[0] for m in sys.modules), sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    env = dict(os.environ, ALLSPARK_PDL="maybe")
    out = subprocess.run([sys.executable, "-m", "allspark_client.settings"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 1 and "ALLSPARK_PDL='maybe'" in out.stderr and "ALLSPARK_OVERLAP=True" in out.stdout
