"""Who may reach a pool: its unix socket's permissions, TLS on TCP, and the bearer token every RPC must carry.

- unix socket: a directory the pool creates for it is 0700 (0710 with `--socket-group`); the socket is bound under
  a umask that leaves it 0600 (0660 with the group) from the first moment, never looser. A directory that exists
  already is used as it is unless another user could replace the socket in it (writable by others without the
  sticky bit, or owned by another non-root user): then the pool refuses to start, saying so. A path something
  answers on (a live pool) or that is not a socket is never replaced (allspark_client/launch/socket_probe.py):
  checked at start and again just before the bind; only a stale socket is. At its end the pool removes the socket
  only if it is still the one it bound (same device and inode), not one another pool bound there since.
- TCP: loopback only, unless `--allow-remote`; then a server certificate (`--tls-cert`, `--tls-key`) and a token are
  required, and `--tls-client-ca` also requires client certificates signed by that CA. Loopback TCP requires a token
  too: every user of the machine can reach a port (a unix socket is 0600), and a pool's calls install models and
  make rank 0 read files its user can read. `--insecure-no-token` serves without one anyway, on the operator's word.
- the token comes from `--token-file` or the ALLSPARK_TOKEN environment variable, never the command line (every
  user sees command lines in ps), and is never logged. With a token set, every RPC without `authorization: Bearer
  <token>` metadata ends UNAUTHENTICATED; the comparison takes constant time.
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass
from typing import Optional

import grpc

from allspark_client import settings
from allspark_client.launch.options import tcp_without_token

log = logging.getLogger("allspark.access")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class AccessError(ValueError):
    """A pool set-up that would let the wrong people in (or a file it needs that cannot be read)."""


@dataclass(frozen=True)
class Access:
    token: Optional[str] = None
    tls_cert: Optional[bytes] = None      # PEM: the server's certificate chain and key
    tls_key: Optional[bytes] = None
    tls_client_ca: Optional[bytes] = None  # PEM: require client certificates signed by this CA
    socket_group: Optional[str] = None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise AccessError(f"cannot read the {what} {path!r}: {e.strerror}") from None


def read_token(token_file: Optional[str]) -> Optional[str]:
    """From the file (its first line), else $ALLSPARK_TOKEN, else None; an empty token is an error."""
    if token_file:
        token = _read(token_file, "token file").decode("utf-8", "replace").strip().splitlines()
        token = token[0].strip() if token else ""
        where = f"the token file {token_file!r}"
    elif (env_token := settings.TOKEN.get()) is not None:
        token, where = env_token.strip(), f"${settings.TOKEN.name}"
    else:
        return None
    if not token:
        raise AccessError(f"{where} holds an empty token")
    return token


def access_from_args(args) -> Access:
    """The rank's --token-file / --tls-* / --socket-group (and $ALLSPARK_TOKEN), checked against the bind:
    --allow-remote needs TLS and a token."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise AccessError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise AccessError("--tls-client-ca (client certificates) needs --tls-cert and --tls-key")
    if args.tls_cert and args.port is None:
        raise AccessError("--tls-cert is for TCP (--port); a unix socket is guarded by its permissions")
    access = Access(token=read_token(args.token_file),
                    tls_cert=_read(args.tls_cert, "TLS certificate") if args.tls_cert else None,
                    tls_key=_read(args.tls_key, "TLS key") if args.tls_key else None,
                    tls_client_ca=_read(args.tls_client_ca, "client CA") if args.tls_client_ca else None,
                    socket_group=args.socket_group)
    if args.port is not None and args.allow_remote and not (access.tls and access.token):
        missing = [m for m, ok in (("--tls-cert/--tls-key", access.tls), (f"--token-file or ${settings.TOKEN.name}",
                                                                          access.token)) if not ok]
        raise AccessError(f"--allow-remote serves beyond this machine: it needs TLS and a token; missing "
                          f"{' and '.join(missing)}")
    if args.port is not None and args.host not in LOOPBACK and not args.allow_remote:
        raise AccessError(f"refusing to bind {args.host}: pass --allow-remote (with TLS and a token) to listen "
                          f"beyond loopback")
    if args.port is not None and not access.token and not getattr(args, "insecure_no_token", False):
        raise AccessError(tcp_without_token(args.host, args.port))
    return access



# ---- unix sockets --------------------------------------------------------------------------------
def _group_id(group: str) -> int:
    import grp
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise AccessError(f"--socket-group: no group {group!r}") from None


def prepare_socket_dir(path: str, group: Optional[str]) -> None:
    """Create the socket's missing directories 0700 (the last 0710 with a group), or check the existing one."""
    directory = os.path.dirname(os.path.abspath(path))
    missing = []
    d = directory
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        os.mkdir(d, 0o700)
        os.chmod(d, 0o700)           # mkdir's mode passes through the umask
    if missing and group:
        os.chown(directory, -1, _group_id(group))
        os.chmod(directory, 0o710)   # the group may reach the socket, not list or change the directory
    st = os.stat(directory)
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
    foreign = st.st_uid not in (os.getuid(), 0)
    if others_write or foreign:
        raise AccessError(f"the socket directory {directory!r} is {'owned by uid %d' % st.st_uid if foreign else ''}"
                          f"{' and ' if foreign and others_write else ''}"
                          f"{'writable by others' if others_write else ''}: another user could replace the socket; "
                          f"use a directory of your own (or let the pool create one)")
    clear_socket_path(path)


def clear_socket_path(path: str) -> None:
    """Remove a stale socket at `path`; AccessError when something answers there or it is not a socket."""
    from allspark_client.launch.socket_probe import probe
    found = probe("unix:" + path)
    if found.kind == "stale":
        os.unlink(path)
    elif not found.may_become_a_pool:
        raise AccessError(f"{found.detail}: refusing to replace it (stop that pool first, or choose another "
                          f"--socket)")


def socket_identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of the file at `path`, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def remove_own_socket(path: str, identity: Optional[tuple[int, int]]) -> None:
    """Unlink `path` only if it is still the socket this pool bound (`identity`, from socket_identity)."""
    if identity is not None and socket_identity(path) == identity:
        os.unlink(path)
    elif identity is not None and os.path.lexists(path):
        log.warning("left %s in place: it is no longer the socket this pool bound", path)


def bind_unix(server, path: str, group: Optional[str]) -> None:
    """Bind the socket 0600 (0660 with a group) without a moment of looser permissions, and never over a file that
    appeared at `path` meanwhile. gRPC unlinks whatever is at the bound path when it binds and again when the server
    stops, so it binds a name of this process's own beside `path`; that socket is then hard-linked to `path` (link()
    fails where a file exists: nothing is replaced) and its own name removed, which gRPC's unlink at stop then finds
    gone. `path` itself is removed by remove_own_socket only while it is still this socket."""
    clear_socket_path(path)          # again: another pool may have bound it while this one loaded its models
    own = os.path.join(os.path.dirname(path), f".{os.getpid()}.sock")
    if os.path.lexists(own):         # left by a process of this pid killed outright
        os.unlink(own)
    mode = 0o660 if group else 0o600
    old = os.umask(0o777 & ~mode)
    try:
        if server.add_insecure_port("unix:" + own) == 0:
            raise OSError(f"cannot bind the unix socket {own!r}")
    finally:
        os.umask(old)
    try:
        if group:
            os.chown(own, -1, _group_id(group))
        os.chmod(own, mode)
        try:
            os.link(own, path)
        except FileExistsError:
            clear_socket_path(path)  # a stale socket that appeared meanwhile is replaced, a live one never
            os.link(own, path)
    finally:
        os.unlink(own)


# ---- TCP -----------------------------------------------------------------------------------------
def server_credentials(access: Access):
    return grpc.ssl_server_credentials([(access.tls_key, access.tls_cert)], root_certificates=access.tls_client_ca,
                                       require_client_auth=access.tls_client_ca is not None)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Every RPC must carry `authorization: Bearer <token>`; others end UNAUTHENTICATED (never echoing it)."""

    DENIED = "missing or wrong bearer token (ClientEngine(token=...) or $ALLSPARK_TOKEN)"

    def __init__(self, token: str):
        self._expected = ("Bearer " + token).encode()

    def _allowed(self, details) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._allowed(handler_call_details):
            return handler
        log.warning("refused %s: %s", handler_call_details.method, self.DENIED)

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.DENIED)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.DENIED)
            yield  # pragma: no cover (an async generator, as a server stream handler must be)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer,
                                                   handler.response_serializer)


def interceptors(access: Access) -> list:
    return [TokenCheck(access.token)] if access.token else []


def bind(server, address: str, access: Access) -> None:
    """Bind `address` ('unix:/path' or 'host:port') on the grpc.aio server under `access`."""
    if address.startswith("unix:"):
        bind_unix(server, address[5:], access.socket_group)
        return
    port = (server.add_secure_port(address, server_credentials(access)) if access.tls
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind gRPC address {address!r}")
