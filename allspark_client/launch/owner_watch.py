"""OwnerWatch: a pool that ClientEngine spawned ends when the process that spawned it ends, however it ends.

The link: ClientEngine hands its launcher the read end of a pipe whose write end only it holds (--owner-fd). When
the owner exits (close() or not, an exception, SIGKILL, the OOM killer) the kernel closes the write end and the
launcher reads EOF at once. The check: the owner's pid and start time (--owner-pid), looked at every POLL_S, for
what the link cannot cover: the write end copied into a child the owner forked (the pipe then stays open while that
child runs) and a launcher re-parented before it looked. Not PR_SET_PDEATHSIG: that fires when the *thread* that
spawned the launcher exits, and a ClientEngine may be made in a short-lived thread. Torch-free.
"""
from __future__ import annotations

import os
import select
import threading
from typing import Callable, Optional

import psutil

POLL_S = 0.5


def _start_time(pid: int) -> Optional[float]:
    """The process's start time, or None once it is gone (a zombie is gone: it only waits to be reaped)."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


class OwnerWatch:
    """Calls `on_gone(reason)` once, on its own thread, when the owner `pid` has ended (EOF on `fd`, or the pid
    gone or taken by another process). `expect_parent`: the owner spawned this process, so it must be our parent
    when we start; otherwise it died before we looked and init (or a subreaper) adopted us."""

    def __init__(self, pid: int, fd: Optional[int], on_gone: Callable[[str], None], expect_parent: bool = True):
        self.pid, self.fd, self.on_gone = pid, fd, on_gone
        self.gone: Optional[str] = None
        started = _start_time(pid)
        if expect_parent and os.getppid() != pid:
            started = None
        self._started = started
        self._thread = threading.Thread(target=self._run, name="allspark-owner-watch", daemon=True)
        self._thread.start()

    def _alive(self) -> bool:
        return self._started is not None and _start_time(self.pid) == self._started

    def _run(self) -> None:
        while self._alive():
            if self.fd is None:
                threading.Event().wait(POLL_S)
                continue
            ready, _, _ = select.select([self.fd], [], [], POLL_S)
            if ready and not os.read(self.fd, 4096):     # EOF: every copy of the write end is closed
                self._report(f"the process that spawned this pool (pid {self.pid}) has exited")
                return
        self._report(f"the process that spawned this pool (pid {self.pid}) is gone")

    def _report(self, reason: str) -> None:
        self.gone = reason
        self.on_gone(reason)
