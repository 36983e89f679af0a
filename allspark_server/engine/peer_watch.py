"""PeerWatch: rank 0's eye on the ranks that run on its own machine.

When a rank dies, mpirun takes the job down: it notices the death, then signals the other ranks (Open MPI 5: SIGTERM
after 0.25 s, SIGKILL after 0.5 s). Until then rank 0 sits in a collective with the dead rank and its clients'
streams hang; if mpirun is slow to notice (a loaded machine) or cannot act, they hang longer. PeerWatch does not
wait for that: every rank reports who it is (`identity()`: boot id, pid namespace, pid and start time), and a thread
of rank 0 looks every POLL_S at the peers it can see (same kernel boot, same pid namespace) in /proc. A peer that is
gone, a zombie, or a new process under its pid is a lost rank: `on_lost(message)` is called once. The Engine then
ends every open stream with that message and exits (`exit_now`: not through MPI_Abort, which goes through mpirun),
sooner than mpirun would kill it and whether or not mpirun acts; mpirun then ends the job non-zero. Peers on other
hosts are left to mpirun and the step watchdog (step_watchdog.py).

`stand_down()` turns the watch off just before a clean shutdown tells the workers to exit (Engine wires it to the
engine thread). Linux only: where /proc is missing, `identity()` is None and nothing is watched.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)

POLL_S = 0.1


@dataclass(frozen=True)
class RankIdentity:
    boot_id: str
    pid_namespace: str
    pid: int
    start_time: str      # /proc/<pid>/stat field 22: clock ticks after boot; tells a reused pid apart


def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/<pid>/stat from its state field on (the command name before it may hold spaces), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def identity(pid: Optional[int] = None) -> Optional[RankIdentity]:
    """Who process `pid` (default: this one) is, as a peer on the same machine would check it; None without /proc
    or once the process is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        pid_namespace = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return RankIdentity(boot_id, pid_namespace, pid, fields[19])


def is_alive(peer: RankIdentity) -> bool:
    """The process `peer` names still runs (not exited, not a zombie, its pid not taken by another process)."""
    fields = _stat_fields(peer.pid)
    return fields is not None and fields[0] not in ("Z", "X") and fields[19] == peer.start_time


def exit_now(message: str) -> None:
    """A rank of the pool died: this process (rank 0) exits at once, without MPI (which would wait for the dead)."""
    log.critical("%s: rank 0 exits, the pool cannot go on", message)
    sys.stderr.flush()
    os._exit(1)


class PeerWatch:
    def __init__(self, identities: Sequence[Optional[RankIdentity]], on_lost: Callable[[str], None] = exit_now):
        """`identities`: every rank's identity(), by rank (this process is rank 0)."""
        me = identities[0]
        self.watched = {rank: peer for rank, peer in enumerate(identities)
                        if rank > 0 and me is not None and peer is not None
                        and (peer.boot_id, peer.pid_namespace) == (me.boot_id, me.pid_namespace)}
        self.on_lost = on_lost
        self._off = threading.Event()
        self._thread = None
        if self.watched:
            self._thread = threading.Thread(target=self._run, name="allspark-peer-watch", daemon=True)
            self._thread.start()

    def stand_down(self) -> None:
        """The workers are about to exit on purpose (a clean shutdown): stop watching them."""
        self._off.set()

    def _run(self) -> None:
        while not self._off.wait(POLL_S):
            for rank, peer in self.watched.items():
                if not is_alive(peer) and not self._off.is_set():
                    self._off.set()
                    message = f"the pool lost rank {rank}: its process (pid {peer.pid}) exited"
                    log.error("%s", message)
                    self.on_lost(message)
                    return
