"""The gRPC channel to a pool: plaintext (a unix socket, loopback TCP) or TLS (root certificates, optionally a
client certificate), with the pool's bearer token on every call when one is given (`token=`, else
$ALLSPARK_TOKEN). Shared by ClientEngine and allspark-health. The token is never logged or put in a message."""
from __future__ import annotations

from typing import Optional, Union

import grpc

from allspark_client import settings

MAX_MESSAGE_BYTES = 64 << 20
Pem = Union[bytes, str, None]     # PEM bytes, or a path to a PEM file


def normalize_address(address: str) -> str:
    if address.startswith("/"):
        return "unix:" + address
    return address


def _pem(value: Pem, what: str) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {value!r}: {e.strerror}") from None


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._header = ("authorization", "Bearer " + token)

    def _with_token(self, details):
        return details._replace(metadata=list(details.metadata or ()) + [self._header])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


RECONNECT_BACKOFF_MS = 500


def failure_reason(e: grpc.RpcError, address: str, tls: bool) -> str:
    """gRPC's reason why a call to `address` failed, with a hint where a likely mistake shows."""
    details = e.details() or ""
    hint = ""
    if "No such file" in details or "Connection refused" in details:
        pass                                # nothing listens there: the reason says it all
    elif "HTTP/2" in details or "http1.x" in details:
        hint = " (something answers there, but not gRPC: an HTTP server, not an allspark pool?)"
    elif e.code() == grpc.StatusCode.UNAVAILABLE and tls:
        hint = " (does the pool serve TLS with a certificate that root_certificates signed?)"
    elif e.code() == grpc.StatusCode.UNAVAILABLE and not address.startswith("unix:"):
        hint = " (if the pool serves TLS, pass root_certificates=...)"
    return f"{e.code().name}: {details}{hint}"


def open_channel(address: str, token: Optional[str] = None, root_certificates: Pem = None,
                 certificate_chain: Pem = None, private_key: Pem = None) -> grpc.Channel:
    """TLS when root_certificates (the CA that signed the pool's certificate) is given; certificate_chain and
    private_key add a client certificate (pools started with --tls-client-ca require one)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               # a pool that went down and came back (systemd's Restart=on-failure) is found again within
               # about a second: gRPC's default reconnect backoff grows to two minutes
               ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
               ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
               ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("certificate_chain and private_key go together (the client certificate and its key)")
    if certificate_chain is not None and root_certificates is None:
        raise ValueError("a client certificate needs TLS: pass root_certificates too")
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(_pem(root_certificates, "root certificates"),
                                             _pem(private_key, "client key"),
                                             _pem(certificate_chain, "client certificate"))
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    token = token if token is not None else settings.TOKEN.get()
    if token:
        channel = grpc.intercept_channel(channel, _Bearer(token.strip()))
    return channel
