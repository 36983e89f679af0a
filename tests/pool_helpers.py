"""Shared by tests/pool/test_pool_failures.py, test_pool_grpc.py and test_pool_slow_clients.py (the `loader` /
`new_pool` fixtures are in conftest.py): a 2-rank allspark-launch pool of its own per test, which kills every
process it started."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

import psutil
import pytest
from helpers import LONG_RUN_TOKENS, collect

from allspark_client import ClientEngine, GenerateRequestStatus
from allspark_client import client as client_module
from allspark_client.types import AsStatus

MODEL = "llama"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 120.0


# ---- pool plumbing --------------------------------------------------------------------------------
def repo_env() -> dict:
    """The environment for a child process that imports this checkout (the repo root first on PYTHONPATH)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


def cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def _is_rank(p: psutil.Process, socket_path: str | None = None) -> bool:
    """A rank is a python process running allspark_server (mpirun's own command line names it too)."""
    cmd = cmdline(p)
    return (bool(cmd) and os.path.basename(cmd[0]).startswith("python") and "allspark_server" in cmd
            and (socket_path is None or socket_path in cmd))


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Pool:
    """One allspark-launch pool on a unix socket in a fresh short directory (socket paths are
    limited to ~107 bytes, pytest's tmp_path can be longer)."""

    def __init__(self, ranks: int = 2, extra_args: tuple[str, ...] = (), socket_name: str = "pool.sock",
                 hosts: list[str] | None = None, mpirun_args: tuple[str, ...] = ()):
        """`hosts`: a multi-host pool (--host, one rank per host's NUMA node) instead of --ranks; `mpirun_args`
        go to mpirun (after --)."""
        self.dir = tempfile.mkdtemp(prefix="asfail-")
        self.socket = os.path.join(self.dir, socket_name)      # socket_name may name a subdirectory
        self.address = "unix:" + self.socket
        self.log_path = os.path.join(self.dir, "pool.log")
        self.clients: list[ClientEngine] = []
        self.known: list[psutil.Process] = []
        env = repo_env()
        with open(self.log_path, "wb") as log:
            where = ["--host", ",".join(hosts)] if hosts else ["--ranks", str(ranks)]
            self.proc = subprocess.Popen([sys.executable, "-m", "allspark_client.launch.launcher", *where,
                                          "--socket", self.socket, *extra_args, "--", *mpirun_args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                         env=env)
        self.launcher = psutil.Process(self.proc.pid)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-6000:]
        except OSError:
            return ""

    def _remember_descendants(self) -> None:
        try:
            kids = self.launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        kids += self.rank_processes_left()       # ranks on other "hosts" are children of their host's sshd
        seen = {(p.pid, p.create_time()) for p in self.known if _alive(p)}
        for p in kids:
            try:
                key = (p.pid, p.create_time())
                if key not in seen:
                    seen.add(key)
                    self.known.append(p)
            except psutil.NoSuchProcess:
                pass

    def wait_ready(self, ranks: int = 2, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while "allspark pool ready" not in self.log():
            assert self.proc.poll() is None, f"the pool exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no ready pool after {timeout_s}s:\n{self.log()}"
            time.sleep(0.05)
        self._remember_descendants()
        assert len(self.ranks()) == ranks, ([cmdline(p) for p in self.known], self.log())

    def ranks(self) -> list[psutil.Process]:
        return [p for p in self.known if _is_rank(p)]

    def client(self) -> ClientEngine:
        c = ClientEngine(self.address, start_timeout_s=60)
        self.clients.append(c)
        return c

    def rank_processes_left(self) -> list[psutil.Process]:
        """Every live rank of this pool, found by its socket path (also ranks orphaned by mpirun)."""
        out = []
        for p in psutil.process_iter():
            if _is_rank(p, self.socket) and _alive(p):
                out.append(p)
        return out

    def kill(self) -> None:
        """Kill everything this pool started (idempotent; safe after the pool has exited). A client of a pool that
        has exited closes without close()'s wait for the pool to come back (its release of the open requests)."""
        gone = self.proc.poll() is not None
        for c in self.clients:
            try:
                with mock.patch.object(client_module, "RECONNECT_WAIT_S", 0.0) if gone else contextlib.nullcontext():
                    c.close()
            except Exception:
                pass
        self._remember_descendants()
        procs = self.known + self.rank_processes_left()
        if self.proc.poll() is None:     # not reaped yet: the pid (= its session's group id) is still ours
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            try:
                p.kill()          # psutil checks the process identity: no pid-reuse accidents
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        # dead once exited (a zombie): their memory and sockets are freed then, and reaping them is init's business,
        # which on some machines takes seconds (psutil.wait_procs waits for the reaping)
        wait_until(lambda: not any(_alive(p) for p in procs), 15.0, 0.01)
        shutil.rmtree(self.dir, ignore_errors=True)


def install(client: ClientEngine, loader, max_length: int = 1024, max_batch: int = 8) -> None:
    cfg = (loader.create_reference_runtime_config_builder(MODEL, "cpu", [0], max_batch=max_batch)
           .max_length(max_length).kv_cache_span_size(16).build())
    assert client.install_model(cfg) == AsStatus.ALLSPARK_SUCCESS
    assert client.start_model(MODEL) == AsStatus.ALLSPARK_SUCCESS


def greedy_cfg(n: int) -> dict:
    return {"top_k": 1, "max_new_tokens": n, "eos_token_id": []}


def client_greedy(client: ClientEngine, ids, n: int) -> list[int]:
    status, handle, queue = client.start_request(MODEL, {"input_ids": ids}, greedy_cfg(n))
    assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    tokens, _, final = collect(queue, timeout_s=60)
    assert final == GenerateRequestStatus.GenerateFinished, (final, queue.ErrorMessage())
    assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS
    return tokens


def read_at_least(queue, n: int, timeout_s: float = 60.0) -> list[int]:
    tokens = []
    deadline = time.monotonic() + timeout_s
    while len(tokens) < n:
        el = queue.GetWithTimeout(int(max(0.0, deadline - time.monotonic()) * 1000))
        if el is None:
            raise AssertionError(f"got {len(tokens)} tokens, status {queue.GenerateStatus().name}, "
                                 f"error {queue.ErrorMessage()!r}")
        tokens.extend(el.ids_from_generate)
    return tokens


PREMISE_TRIES = 3   # how often a set-up that a stalled test process spoiled is done again


class PremiseSpoiled(Exception):
    """What a test acts on was provably gone when it acted (a stream it meant to cut had already generated all its
    tokens): the test process stalled between setting up and acting, and the test says nothing about the code. Tests
    marked REDO_SPOILED are then run again from the start (a fresh pool), PREMISE_TRIES times in all; any other
    failure fails them at once."""


REDO_SPOILED = pytest.mark.flaky(reruns=PREMISE_TRIES - 1, only_rerun=[PremiseSpoiled])


def ran_out(queue, max_new_tokens: int = LONG_RUN_TOKENS) -> bool:
    """The stream ended by itself, all its tokens generated: whatever a test did to it came after its end."""
    return (queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
            and queue.GeneratedLength() == max_new_tokens)


def start_running_streams(client: ClientEngine, prompts, min_tokens: int = 2,
                          max_new_tokens: int = LONG_RUN_TOKENS) -> list[tuple]:
    """One long greedy stream per prompt, each having delivered `min_tokens` and none of them ended:
    [(ids, handle, queue, tokens read)]. The tests built on this are about what happens to *running* streams, and a
    test process that did not run for a whole stream (seen in CI: stalls of 8-14 s while the pool ran on) finds
    some already finished; those are then stopped, released and started again, PREMISE_TRIES times at most, and
    then the test is spoiled (PremiseSpoiled: REDO_SPOILED runs it again on a fresh pool). A stream that ended any
    other way than with all its tokens fails at once."""
    tries = []
    for _ in range(PREMISE_TRIES):
        started, since = [], time.monotonic()
        for ids in prompts:
            status, handle, queue = client.start_request(MODEL, {"input_ids": ids}, greedy_cfg(max_new_tokens))
            assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
            started.append((ids, handle, queue))
        firsts = [read_at_least(queue, min_tokens) for _, _, queue in started]
        ended = [queue for _, _, queue in started if queue.GenerateStatus().is_terminal]
        for queue in ended:
            assert ran_out(queue, max_new_tokens), (f"a stream ended {queue.GenerateStatus().name} after "
                                                    f"{queue.GeneratedLength()} tokens: {queue.ErrorMessage()!r}")
        # the pool's own count as well as this process's view: a reader thread that fell behind shows a stream
        # still running that the pool has finished
        running = client.get_as_engine_stat(MODEL).running_request
        if not ended and running >= len(started):
            return [(ids, handle, queue, first) for (ids, handle, queue), first in zip(started, firsts)]
        tries.append(f"{len(ended)} ended and {running} running of {len(started)} after "
                     f"{time.monotonic() - since:.1f} s")
        for _, handle, _ in started:
            stop_and_release(client, handle)
    raise PremiseSpoiled(f"streams of {max_new_tokens} tokens had all their tokens before this process read "
                         f"{min_tokens} of each, {PREMISE_TRIES} times ({'; '.join(tries)}): the test process was "
                         f"stalled for whole streams")


def stop_and_release(client: ClientEngine, handle) -> None:
    assert client.stop_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()


def wait_until(cond, timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


STALL_S = 0.5   # a poll that wakes this much late means this process was not running (as step_watchdog.py)


def wait_until_running(cond, since: float, bound_s: float, step_s: float = 0.02) -> tuple[bool, float]:
    """cond() within bound_s of `since` (a time.monotonic()), not counting time in which this process did not run
    (a stalled VM, a starved test process: a poll that woke STALL_S or more late); (whether it held, the time not
    counted)."""
    deadline, stalled = since + bound_s, 0.0
    while not cond():
        before = time.monotonic()
        if before > deadline:
            return False, stalled
        time.sleep(step_s)
        late = time.monotonic() - before - step_s
        if late >= STALL_S:
            deadline += late
            stalled += late
    return True, stalled
