"""One pool rank: `python -m allspark_server` under mpirun (normally started by allspark-launch).

Every rank binds its compute threads, joins the MPI job and waits for the others. Rank 0 then
loads the models of the pool config, serves gRPC and drives; the other ranks run the worker loop.
Readiness is reported only when every rank is up (Health RPC, sd_notify). SIGTERM on rank 0 stops
the requests, tells the workers to exit, and everyone exits 0. Any unhandled error aborts the job. SIGUSR1 prints
every thread's stack to stderr (a rank that seems stuck: `kill -USR1 PID`).
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

from allspark_client import settings
from allspark_client.launch.options import default_socket_path
from allspark_client.launch.rank_placement import parse_cpu_list
from allspark_client.types import POOL_DOWN

log = logging.getLogger("allspark.rank")
STOP_GRACE_S = 30   # on SIGTERM, how long stopped streams get to deliver their last reply
# ... and how long their clients then get to read it before the connections close. gRPC closes a connection as
# soon as its last stream ends once the server is stopping, and a client that had not yet read that stream's end
# lost it ("Stream removed": the SIGTERM test, once in five full runs of the suite), so the server is stopped
# only after this.
STOP_LINGER_S = 0.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m allspark_server", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="unix socket path for gRPC (the default)")
    where.add_argument("--port", type=int, help="TCP port (binds 127.0.0.1 unless --host)")
    p.add_argument("--host", default="127.0.0.1", help="bind address for --port")
    p.add_argument("--allow-remote", action="store_true",
                   help="required to bind anything but loopback; then TLS and a token are required too")
    p.add_argument("--socket-group", help="group allowed on the unix socket (0660 in a 0710 directory; default "
                                          "none: 0600 in 0700)")
    p.add_argument("--token-file", help="bearer token every RPC must carry (first line of the file; or "
                                        "$ALLSPARK_TOKEN; never on the command line)")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="TCP without a token: any user of this machine may call the pool (refused otherwise)")
    p.add_argument("--tls-cert", help="TCP: serve TLS with this PEM certificate chain ...")
    p.add_argument("--tls-key", help="... and this PEM private key")
    p.add_argument("--tls-client-ca", help="TCP with TLS: require client certificates signed by this PEM CA")
    p.add_argument("--cpus", default="", help="cores for this rank's threads, e.g. '0-3' (or per rank: '0-3;4-7')")
    p.add_argument("--place-on-host", action="store_true",
                   help="multi-host pools: take this rank's NUMA node and cores from its local rank and this "
                        "host's own topology (placement.py) instead of --cpus")
    p.add_argument("--pid-file", help="rank 0 writes its pid here (the launcher sends it SIGTERM to stop)")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0 = number of --cpus)")
    p.add_argument("--pool-config", help="TOML pool config: models to install and start")
    p.add_argument("--max-streams", type=int, default=4096,
                   help="Generate streams rank 0 serves at once (a stream is a coroutine, not a thread); more are "
                        "refused with ALLSPARK_REQUEST_DENIED (overload)")
    p.add_argument("--stream-stall-timeout", type=float, default=None,
                   help="seconds a Generate stream may wait on a client that does not read it before it is "
                        "dropped and its request released (default 30)")
    p.add_argument("--orphan-grace", type=float, default=None,
                   help="seconds after a client's connection is gone before the pool releases the finished "
                        "requests it left unreleased (default 30)")
    p.add_argument("--step-timeout", type=float, default=None,
                   help="seconds a pool step may take before the pool is declared hung: every stream ends in an "
                        "error and the pool exits non-zero (default: 10 s beyond the slowest step so far)")
    p.add_argument("--log-level", default=settings.LOG_LEVEL.get())
    return p.parse_args(argv)


def grpc_address(args):
    """(address, Access): what rank 0 binds and who may use it (access.py); a set-up that would let the wrong
    people in stops the pool here, before anything loads."""
    from allspark_server.pool.access import AccessError, access_from_args, prepare_socket_dir
    try:
        access = access_from_args(args)
        if args.port is not None:
            return f"{args.host}:{args.port}", access
        path = args.socket or default_socket_path()
        prepare_socket_dir(path, access.socket_group)
    except AccessError as e:
        raise SystemExit(f"allspark pool: {e}") from None
    return f"unix:{path}", access


def bind_threads(args, rank: int) -> int:
    import torch
    per_rank = args.cpus.split(";")
    spec = per_rank[rank] if len(per_rank) > 1 else per_rank[0]   # one list: this rank's own cores
    cpus = parse_cpu_list(spec) if rank < len(per_rank) or len(per_rank) == 1 else []
    if cpus:
        os.sched_setaffinity(0, cpus)
    threads = args.threads or len(cpus) or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(target)
        s.sendall(state.encode())


def serve(comm, args, address: str, access, ranks) -> int:
    from allspark_client.launch.pool_config import load_pool_config
    from allspark_server.engine.engine import Engine
    from allspark_server.pool.access import remove_own_socket, socket_identity
    from allspark_server.pool.service import AllsparkServicer, start_server

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.pid_file:
        try:
            with open(args.pid_file, "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:      # rank 0 on another host than the launcher: SIGTERM then reaches it via mpirun
            log.warning("cannot write the pid file %s (%s)", args.pid_file, e)
    engine = Engine(comm, step_timeout=args.step_timeout, ranks=ranks)
    if args.pool_config:
        for entry in load_pool_config(args.pool_config).models:
            engine.install_model(entry.config)
            if entry.start:
                engine.start_model(entry.config.model_name)
    servicer = AllsparkServicer(engine, comm.world_size, args.max_streams, args.stream_stall_timeout,
                                args.orphan_grace)
    server = start_server(servicer, address, access)
    own_socket = socket_identity(address[5:]) if address.startswith("unix:") else None
    servicer.ready = True
    sd_notify("READY=1")
    print(f"allspark pool ready: {comm.world_size} rank(s), serving {address}", flush=True)
    stop.wait()
    log.info("stopping: finishing in-flight requests")
    sd_notify("STOPPING=1")
    servicer.stopping = "the pool is stopping (SIGTERM): it takes no new calls"
    # requests still running are cut off: their clients get an error, not an end that looks complete (a stop
    # ends them GenerateFinished); the wording ends in POOL_DOWN, so ClientEngine and allspark-serve see a lost pool
    cut = servicer.cut_off_streams(f"the pool stopped (SIGTERM) before this request finished; {POOL_DOWN}")
    if cut:
        log.warning("stopping: %d request(s) still running were cut off", cut)
    lost = engine.shutdown()                  # every request stopped, its stream's last reply sent; workers exit
    if not servicer.wait_streams_closed(STOP_GRACE_S):
        log.warning("streams still open %.0f s after their requests stopped: their clients do not read", STOP_GRACE_S)
    time.sleep(STOP_LINGER_S)                 # their clients read those last replies
    server.stop(grace=1.0).result()           # a unary call still running gets a second
    if own_socket is not None:
        remove_own_socket(address[5:], own_socket)     # not another pool's socket bound there since
    if lost:              # a rank dead or stopped: MPI_Finalize would wait for it forever
        comm.abort(1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # the stacks of a rank that seems stuck
    if args.place_on_host:                          # before MPI starts: it may re-execute this process
        from allspark_server.pool.placement import PlacementError, self_place
        try:
            args.cpus = self_place(sys.argv[1:] if argv is None else list(argv)) or args.cpus
        except PlacementError as e:
            raise SystemExit(f"allspark pool: {e}") from None
    from allspark_server.collective.comm import get_comm
    from allspark_server.engine.peer_watch import identity
    from allspark_server.pool.placement import describe_placement
    comm = get_comm()
    try:
        address, access = grpc_address(args) if comm.rank == 0 else ("", None)   # a bad bind: refused first
        layout = comm.allgather_obj((describe_placement(comm.rank, bind_threads(args, comm.rank)), identity()))
        if comm.rank == 0:                          # every rank is up; where each runs
            for line, _ in layout:
                log.info("%s", line)
            return serve(comm, args, address, access, [who for _, who in layout])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # workers exit when rank 0 says so
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from allspark_server.pool.worker import run_worker
        run_worker(comm)
        return 0
    except BaseException:
        log.critical("rank %d failed:\n%s", comm.rank, traceback.format_exc())
        sys.stderr.flush()
        comm.abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
