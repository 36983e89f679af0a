"""allspark-health: exit 0 when the pool at ADDRESS is ready (every rank up), 1 otherwise.

    allspark-health unix:/run/allspark/default.sock [--timeout 60] [--root-certificates ca.pem]

Waits on the Health call (gRPC wait_for_ready) up to --timeout seconds; prints the pool's version
and size. Usable as a systemd ExecStartPost or a monitoring probe. A pool with a token needs it in
$ALLSPARK_TOKEN; a TLS pool, the CA that signed its certificate (--root-certificates).
"""
from __future__ import annotations

import argparse
import sys

import grpc

from allspark_client._proto import allspark_pb2 as pb
from allspark_client._proto import allspark_pb2_grpc as pb_grpc
from allspark_client.channel import normalize_address, open_channel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="allspark-health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", help="unix:/path, /path or host:port")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--root-certificates", help="PEM file of the CA that signed a TLS pool's certificate")
    a = p.parse_args(argv)
    with open_channel(normalize_address(a.address), root_certificates=a.root_certificates) as channel:
        try:
            reply = pb_grpc.AllsparkStub(channel).Health(pb.HealthRequest(), wait_for_ready=True, timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"not ready: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"{'ready' if reply.ready else 'starting'}: {reply.world_size} rank(s), {reply.version_full}, "
          f"protocol {reply.protocol_version}, rank 0 pid {reply.pid}")
    return 0 if reply.ready else 1


if __name__ == "__main__":
    sys.exit(main())
