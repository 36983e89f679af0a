"""The directories a pool's launcher makes, and their removal after a pool killed outright (torch-free).

Each launcher makes two, named after its pid and removed when its pool ends:
- its run directory in the temp dir (`allspark-launch-<launcher pid>-*`): mpirun's output, rank 0's pid file, and
  Open MPI's session files (PMIx sockets; TMPDIR points there);
- a directory in /dev/shm (`allspark-<launcher pid>-*`) for Open MPI's shared-memory segments. Open MPI's sm
  transport backs each rank's segment with a 16 MiB file there, removed at MPI_Finalize, and /dev/shm is memory.
A launcher killed outright (SIGKILL, the OOM killer) cannot remove them: a host whose pools are killed and restarted
would lose 16 MiB of memory a rank, and gather run directories, each time. So a launcher that starts removes those
of launchers that no longer run.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Optional

import psutil

SHM_ROOT = "/dev/shm"
SHM_PREFIX = "allspark-"             # + <launcher pid>-
RUN_PREFIX = "allspark-launch-"      # + <launcher pid>-


def remove_stale(root: str, prefix: str) -> list[str]:
    """Remove the directories `<prefix><pid>-*` in root of launchers that no longer run; the paths removed. (A pid
    taken since by another process keeps its directory until that one ends: never removed while it may be in
    use.)"""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    name_re = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    for name in names:
        m = name_re.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_pool_dir(root: str, prefix: str) -> str:
    """A fresh directory `<prefix><this pid>-*` in root, those of launchers gone removed first; OSError where root
    is missing or read-only."""
    remove_stale(root, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


def make_run_dir() -> str:
    """This launcher's run directory in the temp dir."""
    return make_pool_dir(tempfile.gettempdir(), RUN_PREFIX)


def make_pool_shm_dir(root: str = SHM_ROOT) -> Optional[str]:
    """A fresh directory for this pool's shared-memory segments, or None where there is no writable `root` (MPI
    then keeps its default)."""
    try:
        return make_pool_dir(root, SHM_PREFIX)
    except OSError:
        return None
