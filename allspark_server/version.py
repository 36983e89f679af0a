"""Version string in DashInfer's format: <major>.<minor>.<patch>/(GitSha1:<sha>)/(Build:<time>)."""
from __future__ import annotations

import functools
import os
import subprocess

from allspark_client import __version__


@functools.lru_cache(maxsize=1)
def version_full() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    sha, when = "unknown", "unknown"
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %cI"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.split()
        if len(out) == 2:
            sha, when = out
    except Exception:
        pass
    return f"{__version__}/(GitSha1:{sha})/(Build:{when})"
