"""allspark-health: exit 0 when the pool at ADDRESS is ready (every rank up), 1 otherwise.

    allspark-health unix:/run/allspark/default.sock [--timeout 60] [--root-certificates ca.pem]

Says at once what is at the address when it is not a pool (socket_probe.py): a file that is not a socket, a socket
not open to this user, or a server that does not speak HTTP/2 exits 1 at once. Nothing there yet (no such path, a
stale socket, a refused port) may be a pool still starting: it says so at once and waits for the Health call (gRPC
wait_for_ready) up to --timeout seconds, then names what is there. Prints the pool's version and size. Usable as a
systemd ExecStartPost or a monitoring probe. A pool with a token needs it in $ALLSPARK_TOKEN; a TLS pool, the CA
that signed its certificate (--root-certificates).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import grpc

from allspark_client._proto import allspark_pb2 as pb
from allspark_client._proto import allspark_pb2_grpc as pb_grpc
from allspark_client.channel import normalize_address, open_channel
from allspark_client.launch.socket_probe import DENIED, HTTP2, probe

NAME_TIMEOUT_S = 3.0


def describe_pool(address: str, timeout_s: float = NAME_TIMEOUT_S) -> Optional[str]:
    """'a pool serves on ADDRESS (rank 0 pid N, K rank(s), VERSION)' when a pool answers there (no TLS); None when
    none does."""
    where = address[len("unix:"):] if address.startswith("unix:") else address
    with open_channel(address) as channel:
        try:
            reply = pb_grpc.AllsparkStub(channel).Health(pb.HealthRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return f"a pool that asks for a token serves on {where}"
            return None
    return (f"a pool {'serves' if reply.ready else 'is starting'} on {where} (rank 0 pid {reply.pid}, "
            f"{reply.world_size} rank(s), {reply.version_full})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="allspark-health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", help="unix:/path, /path or host:port")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--root-certificates", help="PEM file of the CA that signed a TLS pool's certificate")
    a = p.parse_args(argv)
    address = normalize_address(a.address)
    found = None if a.root_certificates else probe(address, min(a.timeout, 3.0))   # a TLS server: gRPC says
    if found is not None and found.kind != HTTP2:
        if not found.may_become_a_pool:       # waiting would not change it
            print(f"{'not ready' if found.kind == DENIED else 'not a pool'}: {found.detail}", file=sys.stderr)
            return 1
        print(f"waiting up to {a.timeout:g} s: {found.detail}", file=sys.stderr, flush=True)
    with open_channel(address, root_certificates=a.root_certificates) as channel:
        try:
            reply = pb_grpc.AllsparkStub(channel).Health(pb.HealthRequest(), wait_for_ready=True, timeout=a.timeout)
        except grpc.RpcError as e:
            now = None if a.root_certificates else probe(address, 1.0)
            why = now.detail if now is not None and now.kind != HTTP2 else f"{e.code().name}: {e.details()}"
            print(f"not ready after {a.timeout:g} s: {why}", file=sys.stderr)
            return 1
    print(f"{'ready' if reply.ready else 'starting'}: {reply.world_size} rank(s), {reply.version_full}, "
          f"protocol {reply.protocol_version}, rank 0 pid {reply.pid}")
    return 0 if reply.ready else 1


if __name__ == "__main__":
    sys.exit(main())
