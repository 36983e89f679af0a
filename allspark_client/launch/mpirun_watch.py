"""MpirunWatch: the launcher's eye on its mpirun. It relays mpirun's output and watches it for MPI's own report
that the job failed; a failed job is never left hanging and never exits 0 (see the class). Torch-free."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

# what Open MPI (PRRTE / ORTE) and MPICH print when a job failed: a rank aborted or died, a host was lost
MPI_FAILURE_MARKERS = (b"MPI_ABORT was invoked", b"has exited due to process rank", b"lost communication with a "
                       b"remote daemon", b"noticed that process rank", b"BAD TERMINATION")
ABORT_GRACE_S = 10.0


class MpirunWatch:
    """Relays mpirun's output (its stdout to ours, its stderr to ours) and watches it for MPI's own report that
    the job failed. Two things mpirun gets wrong across hosts: after an abort it may wait forever for a host it
    can no longer reach (the kill it sent sits unacknowledged in a TCP queue), and after losing a host's daemon
    it may exit 0. Past ABORT_GRACE_S after such a report mpirun is killed, and a failed job never exits 0, so
    that systemd's Restart=on-failure acts on it. mpirun writes to files that this tails, not to pipes: a
    launcher killed outright must not take mpirun's output (and with it mpirun, on its next write) away before
    mpirun has taken the ranks down."""

    def __init__(self, proc: subprocess.Popen, out_path: str, err_path: str):
        self.proc = proc
        self.failed_at: Optional[float] = None
        self._relays = [threading.Thread(target=self._relay, args=(path, stream), daemon=True)
                        for path, stream in ((out_path, sys.stdout), (err_path, sys.stderr))]
        for t in self._relays:
            t.start()

    def _relay(self, path: str, out) -> None:
        pending = b""
        with open(path, "rb") as f:
            while True:
                exited = self.proc.poll() is not None        # read once more after mpirun exits
                chunk = f.read(65536)
                if not chunk:
                    if exited:
                        break
                    time.sleep(0.05)
                    continue
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if self.failed_at is None and any(m in line for line in lines for m in MPI_FAILURE_MARKERS):
                    self.failed_at = time.monotonic()
                self._write(out, b"".join(line + b"\n" for line in lines))
        self._write(out, pending)

    @staticmethod
    def _write(out, data: bytes) -> None:
        try:
            out.buffer.write(data)
            out.flush()
        except (OSError, ValueError):
            pass

    def wait(self) -> int:
        while True:
            try:
                code = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.failed_at is not None and time.monotonic() - self.failed_at > ABORT_GRACE_S:
                print(f"allspark-launch: mpirun did not exit within {ABORT_GRACE_S:.0f} s of the job's failure "
                      f"(a host it cannot reach?): killing it", file=sys.stderr, flush=True)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.proc.wait()
                code = 1
                break
        for t in self._relays:
            t.join(timeout=5.0)
        if code == 0 and self.failed_at is not None:
            print("allspark-launch: mpirun exited 0 after reporting the job failed: exiting 1", file=sys.stderr,
                  flush=True)
            return 1
        return code
