"""The pool's own directory in /dev/shm for Open MPI's shared-memory segments (torch-free).

Open MPI's sm transport backs each rank's segment with a 16 MiB file in /dev/shm, removed at MPI_Finalize. A pool
whose processes are killed outright (SIGKILL, the OOM killer) leaves them there, and /dev/shm is memory: a host
whose pools are killed and restarted loses 16 MiB a rank each time. The launcher therefore points the segments at
a directory of its own (`allspark-<launcher pid>-*`), removes it when the pool ends, and, when a new pool starts,
removes those of launchers that no longer run.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Optional

import psutil

SHM_ROOT = "/dev/shm"
_NAME = re.compile(r"^allspark-(\d+)-")


def remove_stale(root: str = SHM_ROOT) -> list[str]:
    """Remove the segment directories of launchers that no longer run; the paths removed. (A pid taken since by
    another process keeps its directory until that one ends: never removed while it may be in use.)"""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_pool_shm_dir(root: str = SHM_ROOT) -> Optional[str]:
    """A fresh directory for this pool's segments (stale ones removed first), or None where there is no
    writable `root` (MPI then keeps its default)."""
    remove_stale(root)
    try:
        return tempfile.mkdtemp(prefix=f"allspark-{os.getpid()}-", dir=root)
    except OSError:
        return None
