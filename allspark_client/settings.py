"""Every ALLSPARK_* environment variable, declared once: its type, default, what it does and whom it is for.

Kinds:
  user      a setting for people who run allspark;
  ab        a switch that benchmarks flip for A/B runs (its default is the path allspark ships);
  internal  set by allspark itself on a process it starts (allspark-launch -> its ranks), not by users;
  test      a knob of the test suite.

Reading: `settings.PDL.get()` parses the variable from os.environ at its first read in the process, checks it
(SettingError names the variable and the bad value) and caches the value, so code on a hot path may call it
every time. A process that changes its own environment afterwards and wants the new value re-read uses
`override(...)`: it writes os.environ (processes started inside inherit it) and drops the cache on entry and on
exit; `reload()` drops the cache alone. Setting os.environ for a child process needs neither.

Values: a bool takes 1/0, true/false, yes/no, on/off (any case); an empty or blank value of a bool, number or
choice is the default; a string keeps its value as set, empty included (the rank refuses an empty token).

Torch-free (allspark_client never imports torch or allspark_server); allspark_server reads its settings from here.
`python -m allspark_client.settings` prints the values in effect (exit 1 on a bad one); `--markdown` prints
docs/settings.md.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Mapping, Optional, Union

KINDS = {"user": "User settings", "ab": "A/B switches (benchmarks)",
         "internal": "Set by allspark for the processes it starts", "test": "Test-suite knobs"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_UNREAD = object()


class SettingError(ValueError):
    """An ALLSPARK_* variable holds a value its declaration does not take."""


class Setting:
    """One environment variable: `name` (ALLSPARK_...), `type` (bool, int, float or str), `default` (None:
    unset), `kind` (KINDS), `doc`; `choices` for a str that takes a few words, `minimum` for a number (`above`:
    the number must exceed it)."""
    __slots__ = ("name", "type", "default", "kind", "doc", "choices", "minimum", "above", "_value")

    def __init__(self, name: str, type: type, default: Any, kind: str, doc: str,
                 choices: Optional[tuple[str, ...]] = None, minimum: Optional[float] = None, above: bool = False):
        assert name.startswith("ALLSPARK_") and type in (bool, int, float, str) and kind in KINDS, name
        self.name, self.type, self.default, self.kind, self.doc = name, type, default, kind, doc
        self.choices, self.minimum, self.above = choices, minimum, above
        self._value = _UNREAD

    def get(self) -> Any:
        """The value in effect: parsed from os.environ at the first read, then cached (reload() drops it)."""
        value = self._value
        if value is _UNREAD:
            value = self._value = self.read(os.environ)
        return value

    def read(self, environ: Mapping[str, str]) -> Any:
        """The value `environ` gives (not cached): the default when the variable is unset."""
        raw = environ.get(self.name)
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: str) -> Any:
        if self.type is str:
            if self.choices is None:
                return raw
            word = raw.strip().lower()
            if not word:
                return self.default
            if word not in self.choices:
                raise self._error(raw, f"one of {', '.join(self.choices)}")
            return word
        text = raw.strip()
        if not text:
            return self.default
        if self.type is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise self._error(raw, "a boolean: 1/0, true/false, yes/no or on/off")
        try:
            value = self.type(text)
        except ValueError:
            raise self._error(raw, "an integer" if self.type is int else "a number") from None
        if self.minimum is not None and not (value > self.minimum if self.above else value >= self.minimum):
            raise self._error(raw, f"a number {self._bound()}")
        return value

    def _error(self, raw: str, expected: str) -> SettingError:
        return SettingError(f"{self.name}={raw!r}: expected {expected} (docs/settings.md)")

    def _bound(self) -> str:
        return f"{'>' if self.above else '>='} {self.minimum:g}"

    def type_text(self) -> str:
        if self.choices:
            return " \\| ".join(self.choices)
        name = self.type.__name__ if self.type is not str else "string"
        return name if self.minimum is None else f"{name} {self._bound()}"

    def default_text(self) -> str:
        if self.default is None:
            return "unset"
        return ("1" if self.default else "0") if self.type is bool else str(self.default)

    def __repr__(self) -> str:
        return f"Setting({self.name}, {self.type_text()}, default {self.default_text()}, {self.kind})"


ALL: dict[str, Setting] = {}


def _declare(name: str, type: type, default: Any, kind: str, doc: str, **options) -> Setting:
    ALL[name] = setting = Setting(name, type, default, kind, " ".join(doc.split()), **options)
    return setting


# ---- user settings ----
TOKEN = _declare("ALLSPARK_TOKEN", str, None, "user", """
    Bearer token of a pool. A rank started without --token-file requires it on every RPC (an empty value is
    refused); ClientEngine and allspark-health send it when no token is passed; allspark-launch forwards it to
    its ranks. Never put it on a command line.""")
API_KEY = _declare("ALLSPARK_API_KEY", str, None, "user", """
    API key allspark-serve requires as 'Authorization: Bearer KEY' on /v1/* when neither --api-key nor
    --api-key-file is given (empty: none).""")
MAX_BODY_MB = _declare("ALLSPARK_MAX_BODY_MB", float, 16.0, "user", """
    Largest request body allspark-serve reads, in MiB (the default of its --max-body-mb); a larger one is
    refused with 413 before it is read.""", minimum=0, above=True)
LOG_LEVEL = _declare("ALLSPARK_LOG_LEVEL", str, "info", "user", """
    Log level of a pool rank (the default of its --log-level); allspark-launch forwards it to its ranks.""",
                     choices=("debug", "info", "warning", "error", "critical"))
MPIRUN = _declare("ALLSPARK_MPIRUN", str, "mpirun", "user", """
    The mpirun that allspark-launch runs (the default of its --mpirun).""")
NO_NATIVE = _declare("ALLSPARK_NO_NATIVE", bool, False, "user", """
    1: every CPU op runs on the pure-PyTorch path; the native extension is not loaded. setup.py reads it too,
    before the package exists, and builds no extension when it is exactly 1.""")
CPU_ISA = _declare("ALLSPARK_CPU_ISA", str, "auto", "user", """
    The newest CPU features allspark's kernels may use: auto, what the CPU reports; a lower level (portable, avx2,
    avx512, avx512_vnni, avx512_bf16) hides the features above it, so this CPU runs the kernels and GEMM dtypes an
    older kind of CPU would (a cap: a level above the CPU's changes nothing). ATen, oneDNN and MKL have caps of
    their own (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS).""",
                  choices=("auto", "portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"))
BATCH_INVARIANT = _declare("ALLSPARK_BATCH_INVARIANT", bool, False, "user", """
    1: a request's output does not depend on the requests batched with it (CPU ranks): every row count takes the
    native kernels, each row summed in the order it is alone, and prompt rows attend as decode rows do. Costs
    decode throughput with many streams and prompt speed (docs/api.md, "Batch invariance"). GPU ranks: only the
    invariant bf16 / fp16 GEMV of up to 16 rows. Read at the first kernel call of the process (GPU ranks: as a model
    is installed).""")
KV_PREFAULT = _declare("ALLSPARK_KV_PREFAULT", bool, True, "user", """
    1: a CPU rank's KV cache is written once when the model is installed, so its pages exist before the first
    request (no decode step waits for the kernel to clear a fresh page). 0: pages come as spans are first written:
    an install with a large KV budget returns at once and takes RAM only as requests fill the cache (where the cache
    is in transparent huge pages; without them it is written at install either way).""")
MEMORY_BANDWIDTH_GBS = _declare("ALLSPARK_MEMORY_BANDWIDTH_GBS", float, None, "user", """
    Memory bandwidth in GB/s that the engine's roofline statistics (memory_bandwidth_utilization) divide by,
    instead of measuring a copy once per device (about 0.5 s at the first statistics).""", minimum=0, above=True)
PROFILE = _declare("ALLSPARK_PROFILE", bool, None, "user", """
    1: every model installed afterwards profiles its ops, as enable_profiling=True in its runtime config does
    (get_op_profiling_info); read by Engine, in a pool by rank 0. Unset: DashInfer's AS_PROFILE=ON/OFF decides.""")

# ---- A/B switches: the default is the path allspark ships ----
OVERLAP = _declare("ALLSPARK_OVERLAP", bool, True, "ab", """
    Overlapped scheduling of decode steps on GPU ranks with CUDA graphs: step N+1 is launched before step N's
    tokens reach the host. 0: one step at a time. Read when a model is installed.""")
CUDA_GRAPHS = _declare("ALLSPARK_CUDA_GRAPHS", bool, True, "ab", """
    Decode steps of GPU ranks replay CUDA graphs captured at install. 0: every step runs eagerly (and without
    overlapped scheduling). Read when a model is installed.""")
TRITON_GEMV = _declare("ALLSPARK_TRITON_GEMV", bool, True, "ab", """
    Decode rows of bf16 / fp16 dense linears on a GPU go through allspark's Triton GEMV. 0: cuBLAS.""")
PDL = _declare("ALLSPARK_PDL", bool, True, "ab", """
    Programmatic dependent launch of the decode step's Triton kernels on sm_90 and newer (a kernel starts while
    the one before it finishes). 0: plain launches.""")
FUSED_DECODE = _declare("ALLSPARK_FUSED_DECODE", bool, True, "ab", """
    GPU decode attention as one launch (rotary, KV store, attention and the split combine). 0: three
    launches.""")
PEER_ALLREDUCE = _declare("ALLSPARK_PEER_ALLREDUCE", bool, True, "ab", """
    A pool of GPU ranks on one host that all see every GPU sums small allreduces (a decode step's rows) with a
    one-shot kernel over peer memory. 0: NCCL for all of them. Read when the pool starts.""")
PEER_ALLREDUCE_PROTOCOL = _declare("ALLSPARK_PEER_ALLREDUCE_PROTOCOL", str, "sentinel", "ab", """
    How the peer-memory allreduce learns that a peer's rows arrived: sentinel (the rows are written into the
    peers' buffers, whose elements read -0.0 until then) or flags (a flag raised in each peer after the rows).
    Read when the pool starts.""", choices=("sentinel", "flags"))
GUIDED_MASKS = _declare("ALLSPARK_GUIDED_MASKS", str, None, "ab", """
    Where guided decoding's token masks are computed: background (a worker thread, while the model runs) or
    inline (on the engine thread before the step). Unset: background on GPU ranks, inline on CPU ranks.""",
                        choices=("inline", "background"))

# ---- set by allspark on the processes it starts ----
RANK_GPU = _declare("ALLSPARK_RANK_GPU", int, None, "internal", """
    Set by allspark-launch --gpus on each rank, with CUDA_VISIBLE_DEVICES: the GPU it gave the rank, which
    the rank sees as cuda:0; the compute unit must name that GPU for the rank.""", minimum=0)
PLACED = _declare("ALLSPARK_PLACED", bool, False, "internal", """
    Set on a --place-on-host rank that re-executed itself under numactl, so it does not place itself twice.""")

# ---- test-suite knobs ----
FUZZ_EXAMPLES = _declare("ALLSPARK_FUZZ_EXAMPLES", int, 300, "test", """
    Examples per surface of tests/pool/test_fuzz.py (the slow run: 10000).""", minimum=1)
SOAK_REQUESTS = _declare("ALLSPARK_SOAK_REQUESTS", int, 400, "test", """
    Requests of tests/pool/test_soak.py (the slow run: 10000).""", minimum=1)
FAULT_STREAMS = _declare("ALLSPARK_FAULT_STREAMS", int, 8, "test", """
    Concurrent streams of tests/pool/test_pool_failures.py's fault injection (the slow run: 64).""", minimum=1)


def profiling_requested() -> bool:
    """ALLSPARK_PROFILE, or where it is unset DashInfer's AS_PROFILE (ON / OFF, any bool spelling)."""
    if PROFILE.get() is not None:
        return PROFILE.get()
    raw = os.environ.get("AS_PROFILE")
    if raw is None or not raw.strip():
        return False
    try:
        return PROFILE.parse(raw)
    except SettingError:
        raise SettingError(f"AS_PROFILE={raw!r}: expected ON or OFF") from None


def reload() -> None:
    """Drop every cached value: the next get() of each reads os.environ again."""
    for setting in ALL.values():
        setting._value = _UNREAD


def _setting(key: Union[str, Setting]) -> Setting:
    if isinstance(key, Setting):
        return key
    found = ALL.get(key) or ALL.get(f"ALLSPARK_{key}")
    if found is None:
        raise KeyError(f"{key} is not a declared ALLSPARK_* setting (allspark_client/settings.py)")
    return found


def _env_text(value: Any) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


@contextlib.contextmanager
def override(values: Mapping[Union[str, Setting], Any] = (), **by_name: Any) -> Iterator[None]:
    """Within the block, os.environ holds these values (None unsets; True/False are written 1/0) and get()
    returns them; afterwards the environment is as it was. Keys: full names, short names (PDL=0) or Settings.
    Each value is checked on entry."""
    new = {_setting(k): _env_text(v) for k, v in {**dict(values), **by_name}.items()}
    for setting, text in new.items():
        if text is not None:
            setting.parse(text)
    old = {setting: os.environ.get(setting.name) for setting in new}
    try:
        for setting, text in new.items():
            _set_env(setting.name, text)
        reload()
        yield
    finally:
        for setting, text in old.items():
            _set_env(setting.name, text)
        reload()


def _set_env(name: str, text: Optional[str]) -> None:
    if text is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = text


def markdown() -> str:
    """docs/settings.md, from the declarations."""
    lines = ["# Settings: the `ALLSPARK_*` environment variables", "",
             "Generated from `allspark_client/settings.py` by `python -m allspark_client.settings --markdown "
             "> docs/settings.md`; edit the declarations, not this file.", "",
             "Each variable is read once per process, at its first use, and checked: a value its type does not "
             "take raises `SettingError` naming the variable and the value. Booleans take 1/0, true/false, yes/no "
             "or on/off; an empty value of a boolean, number or choice means the default. Code that changes "
             "its own environment later uses `allspark_client.settings.override(...)` (or `reload()`). "
             "`python -m allspark_client.settings` prints the values in effect.", ""]
    for kind, title in KINDS.items():
        lines += [f"## {title}", "", "| Variable | Type | Default | What it does |", "|---|---|---|---|"]
        lines += [f"| `{s.name}` | {s.type_text()} | {s.default_text()} | {s.doc} |"
                  for s in ALL.values() if s.kind == kind]
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv:
        print("usage: python -m allspark_client.settings [--markdown]", file=sys.stderr)
        return 2
    bad = 0
    for setting in ALL.values():
        try:
            print(f"{setting.name}={setting.get()!r}  ({setting.kind})")
        except SettingError as e:
            print(e, file=sys.stderr)
            bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main())
