"""SpawnedPool: a pool that ClientEngine started with allspark-launch for itself, in a fresh directory (its socket,
its log), and ends with it.

The pool also ends when this process ends without ending it (no close(), an exception, SIGKILL): the launcher
watches the read end of a pipe whose write end only this process holds, and this process's pid (owner_watch.py),
and then removes the directory itself.

A spawned pool that serves TCP (`--port` or a pool config among launcher_args) gets a token, as every TCP pool needs
one (pool/access.py): the caller's, else $ALLSPARK_TOKEN, else a random one; written to a 0600 file in the pool's
0700 directory for the launcher (`--token-file`), and kept in `token` for the ClientEngine that spawned it. Unless
launcher_args name a token file or `--insecure-no-token` themselves. Torch-free.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Optional

from allspark_client import settings

END_WAIT_S = 60.0     # how long end() waits for a clean stop before it kills the launcher's process group


def _named(args, *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _value(args, flag: str) -> Optional[str]:
    """The value of `flag` among the launcher's arguments (`--flag V` or `--flag=V`), or None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class SpawnedPool:
    def __init__(self, ranks: Optional[int], numa_nodes: Optional[list[int]], gpus, launcher_args: tuple[str, ...],
                 token: Optional[str] = None):
        self.dir = tempfile.mkdtemp(prefix="allspark-pool-")       # 0700
        own = list(launcher_args)[:list(launcher_args).index("--")] if "--" in launcher_args else list(launcher_args)
        port = _value(own, "--port")
        cmd = [sys.executable, "-m", "allspark_client.launch.launcher"]
        if port is None:
            socket_path = os.path.join(self.dir, "pool.sock")
            self.address = "unix:" + socket_path
            cmd += ["--socket", socket_path]
        else:                      # TCP, as the caller asked
            host = _value(own, "--bind-host") or "127.0.0.1"
            self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.log = os.path.join(self.dir, "pool.log")
        if ranks:
            cmd += ["--ranks", str(ranks)]
        if numa_nodes:
            cmd += ["--numa-nodes", ",".join(map(str, numa_nodes))]
        if gpus is not None:       # the launcher checks the value and says what is wrong with it
            cmd += ["--gpus", gpus if isinstance(gpus, str) else ",".join(map(str, gpus))]
        self.token: Optional[str] = None
        if _named(own, "--port", "--pool-config") and not _named(own, "--token-file", "--insecure-no-token"):
            self.token = token or settings.TOKEN.get() or secrets.token_urlsafe(32)
            token_file = os.path.join(self.dir, "token")
            with os.fdopen(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(self.token + "\n")
            cmd += ["--token-file", token_file]
        link, self._link = os.pipe()      # both ends non-inheritable; the launcher gets the read end only
        # the owner's flags before the user's: launcher_args may end in `-- <mpirun arguments>`
        cmd += ["--owner-pid", str(os.getpid()), "--owner-fd", str(link), "--owner-dir", self.dir]
        cmd += list(launcher_args)
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                             pass_fds=(link,))
        except BaseException:
            os.close(self._link)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        finally:
            os.close(link)

    @property
    def pid(self) -> int:
        """The launcher's pid."""
        return self.proc.pid

    def exit_code(self) -> Optional[int]:
        """None while the launcher runs."""
        return self.proc.poll()

    def output(self) -> str:
        """The end of the pool's output (where a rank's traceback is)."""
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def end(self) -> None:
        """SIGTERM to the launcher (SIGKILL to its process group after END_WAIT_S), waited for; then the link is
        closed and the directory removed. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=END_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._link is not None:
            os.close(self._link)
            self._link = None
        shutil.rmtree(self.dir, ignore_errors=True)
