"""A pool that ClientEngine(ranks=2) spawned ends with the process that spawned it, however that process ends: an
exit without close() and SIGKILL. Every process of the pool (launcher, mpirun, both ranks), found by pid while the
owner lives, is gone within OWNER_BOUND_S, and the pool's directory (socket, log) is removed. A pool started by
allspark-launch itself has no owner and runs on (the rest of the pool suite). OwnerWatch's two signs apart: the pid
check where the link is held open elsewhere, the link's EOF, and an owner gone before the launcher looked."""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from pool_helpers import REPO, _alive, repo_env, wait_until_running

OWNER_BOUND_S = 10.0      # issue 38: every process of the pool gone within 10 s (stalls of this process not counted)
START_S = 180.0

OWNER = textwrap.dedent("""
    import json, sys, time
    from allspark_client import ClientEngine
    client = ClientEngine(ranks=2, start_timeout_s=150)
    print(json.dumps({"rank0": client.health.pid, "socket": client.address[len("unix:"):]}), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the owner fails without close()")
    if sys.argv[1] == "exit":
        sys.exit(0)                  # without close()
    time.sleep(600)                  # until SIGKILL
""")


def start_owner(how: str) -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=REPO, env=repo_env())
    ready, _, _ = select.select([owner.stdout], [], [], START_S)
    line = owner.stdout.readline() if ready else b""
    if not line:
        owner.kill()
        raise AssertionError(f"the owner did not report its pool: {owner.communicate()[1].decode()[-3000:]}")
    info = json.loads(line)
    info["dir"] = os.path.dirname(info["socket"])
    return owner, info


def pool_processes(owner: subprocess.Popen, info: dict) -> list[psutil.Process]:
    """The launcher (the owner's child) and everything under it (mpirun, the ranks), while the owner lives."""
    launchers = [p for p in psutil.Process(owner.pid).children() if "allspark_client.launch.launcher" in p.cmdline()]
    assert len(launchers) == 1, [p.cmdline() for p in psutil.Process(owner.pid).children()]
    procs = launchers + launchers[0].children(recursive=True)
    assert info["rank0"] in [p.pid for p in procs], [p.cmdline() for p in procs]
    names = [" ".join(p.cmdline()) for p in procs]
    assert sum("allspark_server" in n and "python" in os.path.basename(p.cmdline()[0])
               for n, p in zip(names, procs)) == 2, names
    assert any(os.path.basename(p.cmdline()[0]) in ("mpirun", "prterun", "mpiexec") for p in procs), names
    return procs


@pytest.mark.parametrize("how", ["exit", "raise", "sigkill"])
def test_a_spawned_pool_ends_with_its_owner(how):
    owner, info = start_owner(how)
    try:
        procs = pool_processes(owner, info)
    except BaseException:
        owner.kill()
        raise
    try:
        assert os.path.exists(info["socket"])
        if how == "sigkill":
            owner.send_signal(signal.SIGKILL)
        code = owner.wait(timeout=60)
        since = time.monotonic()
        assert code == {"exit": 0, "raise": 1, "sigkill": -signal.SIGKILL}[how], owner.stderr.read().decode()
        gone, stalled = wait_until_running(lambda: not any(_alive(p) for p in procs), since, OWNER_BOUND_S, 0.05)
        left = [" ".join(p.cmdline())[:120] for p in procs if _alive(p)]
        assert gone, f"still running {OWNER_BOUND_S:.0f} s after the owner ended ({how}): {left}"
        took = time.monotonic() - since - stalled
        assert wait_until_running(lambda: not os.path.exists(info["dir"]), since, OWNER_BOUND_S, 0.05)[0], \
            os.listdir(info["dir"])
        print(f"owner ended ({how}): the pool's {len(procs)} processes gone after {took:.1f} s")
    finally:
        owner.kill()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(info["dir"], ignore_errors=True)


def watch_until_gone(owner_pid: int, fd, expect_parent: bool = False):
    from allspark_client.launch.owner_watch import OwnerWatch
    gone = []
    watch = OwnerWatch(owner_pid, fd, gone.append, expect_parent=expect_parent)
    return watch, gone


def test_the_owner_pid_check_covers_a_link_held_open_elsewhere():
    """The pipe's write end copied into another process (a child the owner forked) keeps the link open after the
    owner died: the pid check still sees the owner go. The link alone: EOF the moment its write end closes."""
    from pool_helpers import wait_until
    read_end, write_end = os.pipe()                 # this test holds the write end: the link never reads EOF
    owner = subprocess.Popen(["sleep", "60"])
    try:
        watch, gone = watch_until_gone(owner.pid, read_end)
        assert not wait_until(lambda: gone, 1.5) and watch.gone is None        # the owner runs: nothing
        owner.kill()
        owner.wait()
        assert wait_until(lambda: gone, 10.0), "the owner's death was not seen"
        assert gone == [f"the process that spawned this pool (pid {owner.pid}) is gone"]
    finally:
        owner.kill()
        os.close(write_end)
        os.close(read_end)
    read_end, write_end = os.pipe()
    try:
        watch, gone = watch_until_gone(os.getpid(), read_end)
        assert not wait_until(lambda: gone, 1.0)
        os.close(write_end)
        assert wait_until(lambda: gone, 10.0) and "has exited" in gone[0]
    finally:
        os.close(read_end)


def test_a_launcher_whose_owner_died_before_it_looked_stops_at_once():
    """Spawned by the owner, the launcher must find it as its parent; re-parented already, the owner is gone."""
    from pool_helpers import wait_until
    owner = subprocess.Popen(["sleep", "60"])       # alive, but not this process's parent
    try:
        _, gone = watch_until_gone(owner.pid, None, expect_parent=True)
        assert wait_until(lambda: gone, 10.0) and "is gone" in gone[0]
    finally:
        owner.kill()
        owner.wait()


def test_a_spawned_pool_takes_mpirun_arguments_after_the_separator():
    """docs/pools.md: `-- ARGS` passes ARGS to mpirun. Through ClientEngine the owner's flags used to land after the
    `--` (mpirun refused them, exit 213); now the pool starts, serves, and mpirun did take the argument:
    --tag-output prefixes the ranks' lines in the pool's log with [job,rank] (rank 0 says the pool is ready)."""
    from allspark_client import ClientEngine
    client = ClientEngine(ranks=2, launcher_args=("--", "--tag-output"), start_timeout_s=START_S)
    try:
        assert client.get_rank_id() == 0
        assert client.health.pid > 0
        # mpirun forwards the ranks' stdout on its own schedule: the line may reach the log after the socket is up
        deadline, log = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            log = client._pool_output()
            if re.search(r"\[\d+,0\]<stdout>: allspark pool ready", log):
                break
            time.sleep(0.2)
        assert re.search(r"\[\d+,0\]<stdout>: allspark pool ready", log), log[-2000:]
    finally:
        client.close()
