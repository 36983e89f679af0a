"""allspark-launch's command line: its options, a pool config file's [pool] table as their defaults, the
default socket path, and the checks that reject a multi-host pool given options that describe one host. Torch-free.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from allspark_client import settings

# allspark-launch --help: what the launcher does
DESCRIPTION = """allspark-launch: start a pool as one mpirun job, one rank per NUMA node (or core group, or GPU).

Reads the topology (/sys/devices/system/node, else psutil; /proc/cpuinfo for the ISA), gives each
rank its cores and memory with numactl (or, without numactl, lets the rank pin itself), and runs
`mpirun ... : ...` (Open MPI or MPICH, as root too). `--gpus 0,1`: rank r sees only the r-th GPU
(CUDA_VISIBLE_DEVICES, set by `env` in its part of the command), on the NUMA node nearest it. The
launcher stays the parent of mpirun: SIGTERM/SIGINT to it becomes SIGTERM to rank 0, which stops the
requests and ends every rank cleanly. `--dry-run` prints the exact command. Torch-free (ClientEngine
spawns pools with it).
"""


def default_socket_path() -> str:
    """Where a pool listens unless told otherwise: $XDG_RUNTIME_DIR/allspark/pool.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/allspark-{os.getuid()}"
    return os.path.join(base, "allspark", "pool.sock")


def at_least(low: int, high: Optional[int] = None, number=int):
    """An argparse type: a number (int, or float for seconds) from `low` (to `high`); argparse names the flag and
    the value when it is not."""
    what = "a number" if number is float else "an integer"
    bound = f"from {low} to {high}" if high is not None else f">= {low}"

    def parse(text: str):
        try:
            value = number(text)
        except ValueError:
            value = None
        if value is None or not value >= low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return value
    return parse


def node_list(text: str) -> str:
    """--numa-nodes: comma-separated distinct node numbers."""
    nodes = text.split(",")
    if not all(n.strip().isdigit() for n in nodes) or len({int(n) for n in nodes}) != len(nodes):
        raise argparse.ArgumentTypeError(f"must be distinct NUMA node numbers like 0,1, got {text!r}")
    return text


def tcp_without_token(host: str, port: int) -> str:
    """Why a TCP pool without a token does not start (the launcher's refusal, and the rank's: pool/access.py)."""
    return (f"TCP port {port} on {host} can be reached by every user of this machine (a unix socket is 0600), and a "
            f"pool's calls install models and read files as this user: set a token (--token-file, or "
            f"${settings.TOKEN.name}), or pass --insecure-no-token to serve without one")


def refuse_tcp_without_token(args) -> None:
    """Before anything starts: a TCP pool needs a token, or the operator's --insecure-no-token."""
    if args.port is not None and not (args.token_file or settings.TOKEN.get() or args.insecure_no_token):
        raise SystemExit(f"allspark-launch: {tcp_without_token(args.bind_host, args.port)}")


def multi_host(args) -> bool:
    return bool(args.hosts or args.hostfile)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="allspark-launch", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=at_least(1),
                   help="number of ranks (default: one per NUMA node, or per GPU with --gpus)")
    p.add_argument("--numa-nodes", type=node_list, help="comma-separated NUMA nodes to use (default: all)")
    p.add_argument("--gpus", nargs="?", const="all",
                   help="GPU ranks: rank r sees only the r-th of these GPUs ('0,1'; 'all' or no value: every visible "
                        "GPU) and runs on its NUMA node; --ranks defaults to their number")
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="with --gpus: nvidia-smi, which lists the GPUs")
    p.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    p.add_argument("--socket", help="unix socket for gRPC (default: $XDG_RUNTIME_DIR or /tmp/allspark-UID)")
    p.add_argument("--port", type=at_least(1, 65535), help="serve TCP on 127.0.0.1:PORT instead of a unix socket")
    p.add_argument("--bind-host", default="127.0.0.1",
                   help="with --port: bind address (non-loopback needs --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="with --port: listen beyond loopback (then --tls-cert/--tls-key and a token are required)")
    p.add_argument("--socket-group", help="group allowed on the unix socket (default: only this user)")
    p.add_argument("--token-file", help="bearer token every RPC must carry (or $ALLSPARK_TOKEN); required with --port")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="with --port: serve without a token, callable by any user of this machine")
    p.add_argument("--tls-cert", help="with --port: serve TLS with this PEM certificate chain ...")
    p.add_argument("--tls-key", help="... and this PEM key")
    p.add_argument("--tls-client-ca", help="with TLS: require client certificates signed by this PEM CA")
    p.add_argument("--pool-config", help="TOML pool config ([pool] defaults these flags; [[model]] loads models)")
    p.add_argument("--threads-per-rank", type=at_least(0), default=0, help="0 = the rank's cores")
    p.add_argument("--host", "--hosts", dest="hosts",
                   help="multi-host pool: comma-separated hosts reached by mpirun over ssh; the first one runs "
                        "rank 0 and serves. Each host gets one rank per NUMA node (its own topology) unless "
                        "--ranks-per-host")
    p.add_argument("--hostfile", help="multi-host pool: an mpirun hostfile instead of --host")
    p.add_argument("--ranks-per-host", type=at_least(0), default=0,
                   help="multi-host pool: ranks on each host (default: one per NUMA node of that host; MPICH: 1)")
    p.add_argument("--mpirun", default=settings.MPIRUN.get())
    p.add_argument("--python", default=sys.executable, help="python interpreter for the ranks")
    p.add_argument("--no-numactl", action="store_true", help="do not use numactl even if installed")
    p.add_argument("--topology", help="override the NUMA topology, e.g. '0:0-31;1:32-63'")
    p.add_argument("--max-streams", type=at_least(0), default=0,
                   help="Generate streams rank 0 serves at once (default 4096); more are refused as overload")
    p.add_argument("--step-timeout", type=at_least(0, number=float), default=0,
                   help="seconds a step may take before the pool is declared hung and exits non-zero "
                        "(default: 10 s beyond the slowest step so far)")
    p.add_argument("--stream-stall-timeout", type=at_least(0, number=float), default=0,
                   help="seconds a Generate stream may wait on a client that does not read it before the pool "
                        "drops it and releases its request (default 30)")
    p.add_argument("--orphan-grace", type=at_least(0, number=float), default=0,
                   help="seconds after a client's connection is gone (it died without releasing its requests) "
                        "before the pool releases its finished requests (default 30)")
    p.add_argument("--pid-file", help=argparse.SUPPRESS)
    # ClientEngine's spawned pools (owner_watch.py): the spawning process, the read end of its pipe, its directory
    p.add_argument("--owner-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--owner-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--owner-dir", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("mpirun_args", nargs="*", help="extra mpirun arguments (after --)")
    args = p.parse_args(argv)
    if args.pool_config:
        from allspark_client.launch.pool_config import ConfigError, load_pool_config
        try:
            pool = load_pool_config(args.pool_config)
        except ConfigError as e:
            raise SystemExit(f"allspark-launch: {e}") from None
        for key in ("ranks", "socket", "port", "allow_remote", "mpirun"):
            value = getattr(pool, key)
            if value not in (None, False) and getattr(args, key) in (None, False, "mpirun"):
                setattr(args, key, value)
        if pool.numa_nodes is not None and args.numa_nodes is None:
            args.numa_nodes = ",".join(map(str, pool.numa_nodes))
        if pool.gpus is not None and args.gpus is None:
            args.gpus = pool.gpus if isinstance(pool.gpus, str) else ",".join(map(str, pool.gpus))
        if pool.host != "127.0.0.1" and args.bind_host == "127.0.0.1":
            args.bind_host = pool.host
        args.threads_per_rank = args.threads_per_rank or pool.threads_per_rank
        args.step_timeout = args.step_timeout or pool.step_timeout
        args.stream_stall_timeout = args.stream_stall_timeout or pool.stream_stall_timeout
        args.orphan_grace = args.orphan_grace or pool.orphan_grace
        if pool.hosts and not (args.hosts or args.hostfile):
            args.hosts = ",".join(pool.hosts)
        args.ranks_per_host = args.ranks_per_host or pool.ranks_per_host
    if args.port is None and not args.socket:
        args.socket = default_socket_path()
    check_multi_host(args)
    return args


def check_multi_host(args) -> None:
    if args.hosts and args.hostfile:
        raise SystemExit("allspark-launch: give --host or --hostfile, not both")
    if not multi_host(args):
        if args.ranks_per_host:
            raise SystemExit("allspark-launch: --ranks-per-host needs --host or --hostfile (a multi-host pool)")
        return
    if args.gpus is not None:
        raise SystemExit("allspark-launch: GPU pools across hosts are not supported yet: run one pool per host "
                         "(--gpus), or a CPU pool across hosts")
    for flag in ("ranks", "numa_nodes", "topology"):
        if getattr(args, flag):
            raise SystemExit(f"allspark-launch: --{flag.replace('_', '-')} describes this host; in a multi-host "
                             f"pool every rank places itself on its own host (one per NUMA node, or "
                             f"--ranks-per-host)")
