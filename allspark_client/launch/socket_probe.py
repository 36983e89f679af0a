"""What is at a pool's address, found out without gRPC: nothing there, a file that is not a socket, a stale socket
(nothing listens on it), an HTTP/2 server (a pool, or another gRPC server), or something that answers otherwise or
not at all. allspark-health says which at once where it can; allspark-launch and rank 0 refuse an address something
answers on (a live pool's socket is never replaced). Plaintext only: a TLS server answers the probe as "other".
Torch-free.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

# the HTTP/2 client connection preface and an empty SETTINGS frame: an HTTP/2 server answers with a SETTINGS frame
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4
PROBE_TIMEOUT_S = 3.0

# kinds: nothing listens (yet), so a pool may still come ...
MISSING, STALE, REFUSED = "missing", "stale", "refused"
# ... something is there that is not a pool and will not become one
NOT_SOCKET, DENIED, OTHER, SILENT = "not a socket", "denied", "other", "silent"
HTTP2 = "http2"                 # an HTTP/2 server answers: a pool, most likely
ANSWERS = (HTTP2, OTHER, SILENT)


@dataclass(frozen=True)
class Probe:
    kind: str
    detail: str             # a sentence naming the address and what is there

    @property
    def may_become_a_pool(self) -> bool:
        return self.kind in (MISSING, STALE, REFUSED)


def _connect(address: str, timeout_s: float) -> tuple[socket.socket | None, Probe | None]:
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None, Probe(MISSING, f"{path} does not exist (no pool serves there, or it has not bound yet)")
        except PermissionError as e:
            return None, Probe(DENIED, f"{path}: {e.strerror}")
        if not stat.S_ISSOCK(st.st_mode):
            return None, Probe(NOT_SOCKET, f"{path} is not a socket (a {_file_kind(st.st_mode)})")
        sock, where = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path
        target: object = path
    else:
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as e:
            return None, Probe(REFUSED, f"{address}: cannot resolve it ({e})")
        family, _, _, _, target = infos[0]
        sock, where = socket.socket(family, socket.SOCK_STREAM), address
    sock.settimeout(timeout_s)
    try:
        sock.connect(target)
    except OSError as e:
        sock.close()
        if e.errno == errno.ECONNREFUSED:
            return None, Probe(STALE if address.startswith("unix:") else REFUSED,
                               f"{where} is a stale socket: nothing listens on it (the pool that made it is gone)"
                               if address.startswith("unix:") else f"nothing listens on {where} (connection refused)")
        if e.errno in (errno.EACCES, errno.EPERM):
            return None, Probe(DENIED, f"{where}: {e.strerror} (the socket is not open to this user)")
        return None, Probe(REFUSED, f"cannot connect to {where}: {e.strerror or e}")
    return sock, None


def _file_kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "regular file" if stat.S_ISREG(mode) else "special file"


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """What is at `address` ('unix:/path' or 'host:port'): connect, send the HTTP/2 preface, read the answer."""
    sock, found = _connect(address, timeout_s)
    if found is not None:
        return found
    where = address[len("unix:"):] if address.startswith("unix:") else address
    try:
        sock.sendall(HTTP2_PREFACE)
        answer = b""
        while len(answer) < 9:
            chunk = sock.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
        if answer and not (len(answer) == 9 and answer[3] == SETTINGS_FRAME):
            sock.settimeout(0.2)           # the rest of a line a non-HTTP/2 server said, for the message
            answer += sock.recv(64)
    except socket.timeout:
        if answer:
            return _judge(answer, where)
        return Probe(SILENT, f"something accepts connections on {where} but does not answer in HTTP/2 (silent for "
                             f"{timeout_s:g} s): not an allspark pool")
    except OSError as e:
        answer = b""
        if e.errno not in (errno.ECONNRESET, errno.EPIPE):
            return Probe(OTHER, f"something on {where} broke the connection ({e.strerror or e}): not an allspark pool")
    finally:
        sock.close()
    return _judge(answer, where)


def _judge(answer: bytes, where: str) -> Probe:
    if len(answer) == 9 and answer[3] == SETTINGS_FRAME:
        return Probe(HTTP2, f"an HTTP/2 server (a pool?) answers on {where}")
    said = answer.decode("latin-1").split("\r\n")[0][:60]
    return Probe(OTHER, f"something on {where} answers but not in HTTP/2 "
                        f"({'it said ' + repr(said) if said else 'it closed the connection'}): not an allspark pool")
