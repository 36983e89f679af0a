"""Version string in DashInfer's format: <major>.<minor>.<patch>/(GitSha1:<sha>)/(Build:<time>)."""
from __future__ import annotations

import functools
import os
import subprocess

from allspark_client.version import __version__


@functools.lru_cache(maxsize=1)
def git_info() -> tuple[str, str]:
    """(short sha, commit time) of the checkout this package runs from, or ('unknown', 'unknown')."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %cI"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.split()
        if len(out) == 2:
            return out[0], out[1]
    except Exception:
        pass
    return "unknown", "unknown"


def version_full() -> str:
    sha, when = git_info()
    return f"{__version__}/(GitSha1:{sha})/(Build:{when})"
