"""allspark-launch: start a pool as one mpirun job, one rank per NUMA node (or core group, or GPU).

This module supervises the job: it places the ranks, starts mpirun in the pool's own run directory (removed at
the end), forwards SIGTERM/SIGINT to rank 0 and waits through MpirunWatch. The command line is options.py, the
placement rank_placement.py, the mpirun command mpirun_command.py. Torch-free (ClientEngine spawns pools with it).
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Optional

import psutil

from allspark_client.launch.gpu_topology import gpu_numa_nodes, visible_gpus
from allspark_client.launch.health import describe_pool
from allspark_client.launch.mpirun_command import (
    MULTI_HOST_KEEPALIVE,
    build_command,
    find_mpirun,
    hosts_arguments,
    mpi_flavour,
    openmpi_prefix,
)
from allspark_client.launch.mpirun_watch import MpirunWatch
from allspark_client.launch.options import (
    check_multi_host,
    default_socket_path,
    multi_host,
    parse_args,
    refuse_tcp_without_token,
)
from allspark_client.launch.owner_watch import OwnerWatch
from allspark_client.launch.pool_dirs import RUN_PREFIX, SHM_PREFIX, SHM_ROOT, make_pool_shm_dir, make_run_dir
from allspark_client.launch.rank_placement import (
    RankPlacement,
    format_cpu_list,
    isa_flags,
    parse_cpu_list,
    place_gpu_ranks,
    place_ranks,
    read_topology,
)
from allspark_client.launch.socket_probe import ANSWERS, HTTP2, NOT_SOCKET, probe

# the names this module held before its split, still importable from here
__all__ = ["MULTI_HOST_KEEPALIVE", "RankPlacement", "build_command", "check_multi_host", "default_socket_path",
           "find_mpirun", "format_cpu_list", "hosts_arguments", "isa_flags", "main", "mpi_flavour", "multi_host",
           "openmpi_prefix", "parse_args", "parse_cpu_list", "place_gpu_ranks", "place_ranks", "read_topology"]


# What mpirun's process runs first (Linux), then becomes mpirun: SIGTERM when the launcher dies, and an exit at once if
# it already has. Not a preexec_fn: one makes subprocess run Python's at-fork handlers in the forked child, gRPC's among
# them, and a child doing that has aborted in gRPC's poller before its exec (tests/models/test_gguf_limits.py)
DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG, kept across exec
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """`cmd` started so that it gets SIGTERM when this process dies (DIE_WITH_PARENT)."""
    return [sys.executable, "-S", "-c", DIE_WITH_PARENT, str(os.getpid()), *cmd]


OWNER_GONE_GRACE_S = 5.0   # a pool whose owner is gone: time for rank 0's clean stop before mpirun is ended
MPIRUN_TERM_GRACE_S = 3.0  # ... and for mpirun to end its ranks after SIGTERM before its process group is killed


def stop_pool(proc: subprocess.Popen, pid_file: str) -> None:
    """SIGTERM to rank 0, which stops the requests and ends every rank; to mpirun while rank 0 is not up yet."""
    try:
        with open(pid_file) as f:
            os.kill(int(f.read().strip()), signal.SIGTERM)
    except (OSError, ValueError):
        proc.terminate()                                     # rank 0 not up yet, or on another host


def end_orphaned_pool(proc: subprocess.Popen, pid_file: str, reason: str) -> None:
    """The owner of a spawned pool is gone (owner_watch.py): the pool stops cleanly, or is ended."""
    print(f"allspark-launch: {reason}: stopping the pool", file=sys.stderr, flush=True)
    stop_pool(proc, pid_file)
    for grace, end in ((OWNER_GONE_GRACE_S, proc.terminate), (MPIRUN_TERM_GRACE_S, lambda: kill_job(proc))):
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            end()


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL to mpirun and everything under it (Open MPI puts each rank in a process group of its own)."""
    try:
        job = psutil.Process(proc.pid)
        procs = job.children(recursive=True) + [job]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()                 # psutil checks the process's identity: never a reused pid
        except psutil.NoSuchProcess:
            pass


def shm_dir_wanted(args, flavour: str) -> bool:
    """The shared-memory segments in a directory of the pool's own (pool_dirs.py), so that a pool killed outright
    does not leave 16 MiB a rank in /dev/shm; one host only, since the directory exists on this one, and not where
    the user chose one. (vader: the transport's name in Open MPI 4, a synonym of sm in 5.)"""
    return flavour == "openmpi" and not multi_host(args) and not any(
        f"OMPI_MCA_btl_{name}_backing_directory" in os.environ for name in ("sm", "vader"))


def added_environment(args, flavour: str, run_dir: str, shm_dir: Optional[str]) -> dict[str, str]:
    """What the launcher adds to mpirun's environment."""
    added = {}
    if flavour == "openmpi" and os.geteuid() == 0:
        added.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if multi_host(args):
        # mpirun's link to each host's daemon: notice a host gone silent in ~20 s, not Open MPI's 8 minutes
        for prefix in ("PRTE_MCA_", "OMPI_MCA_"):      # Open MPI 5 (PRRTE) and 4 (ORTE)
            for name, value in MULTI_HOST_KEEPALIVE.items():
                if prefix + name not in os.environ:
                    added[prefix + name] = value
    # MPI's session files (PMIx sockets, shared-memory segments) go in this pool's own directory, removed when the
    # pool ends: Open MPI names them /tmp/ompi.<mpirun pid>, and a pool killed outright leaves its directory
    # behind, where a later mpirun that happens to get the same pid fails with "The PMIx server's listener thread
    # failed to start" (seen after ~100 killed pools)
    added["TMPDIR"] = run_dir
    if shm_dir:
        added["OMPI_MCA_btl_vader_backing_directory"] = shm_dir
    return added


def dry_run_header(args, topo, placements, flavour: str, numactl: Optional[str]) -> str:
    if multi_host(args):
        return (f"# multi-host pool ({args.hosts or 'hostfile ' + args.hostfile}), {flavour}: each rank takes its "
                f"NUMA node and cores on its own host (--place-on-host)")
    gpus = {p.gpu: p.node for p in placements if p.gpu is not None}
    return (f"# topology {({n: format_cpu_list(c) for n, c in topo.items()})}, {flavour}, "
            f"numactl {'yes' if numactl else 'no'}, isa {','.join(isa_flags()) or 'unknown'}"
            + (f", gpu: numa node {gpus}" if gpus else ""))


def refuse_a_taken_address(args) -> None:
    """A pool (or anything else) answering where this one would serve is never replaced: the launcher stops here,
    naming it. (A stale socket is fine: rank 0 replaces it. A multi-host pool's rank 0 checks on its own host.)"""
    if multi_host(args):
        return
    address = f"unix:{os.path.abspath(args.socket)}" if args.port is None else f"{args.bind_host}:{args.port}"
    found = probe(address)
    if found.kind not in ANSWERS + (NOT_SOCKET,):
        return
    what = (describe_pool(address) if found.kind == HTTP2 else None) or found.detail
    flag = "--socket" if args.port is None else "--port"
    raise SystemExit(f"allspark-launch: {what}: refusing to start another pool there (stop that one first, or "
                     f"pass another {flag})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        refuse_tcp_without_token(args)
        refuse_a_taken_address(args)
    topo = {} if multi_host(args) else read_topology(args.topology)
    if multi_host(args):
        placements = []                              # each rank places itself on its own host
    elif args.gpus is not None:
        if args.numa_nodes:
            raise SystemExit(f"allspark-launch: --gpus {args.gpus} and --numa-nodes {args.numa_nodes} cannot be "
                             f"combined: a GPU rank runs on its GPU's NUMA node")
        gpu_nodes = gpu_numa_nodes(visible_gpus(args.gpus), args.sysfs_root, args.nvidia_smi)
        placements = place_gpu_ranks(topo, gpu_nodes, args.ranks)
    else:
        nodes = [int(n) for n in args.numa_nodes.split(",")] if args.numa_nodes else None
        placements = place_ranks(topo, args.ranks, nodes)
    numactl = None if args.no_numactl else shutil.which("numactl")
    try:
        args.mpirun, found = find_mpirun(args.mpirun), True
    except SystemExit:
        if not args.dry_run:
            raise
        found = False                   # a dry run still prints the command it would run
    flavour = mpi_flavour(args.mpirun) if found else "openmpi"
    if args.dry_run:
        print(dry_run_header(args, topo, placements, flavour, numactl))
        # the directories are made at start: a dry run shows their names with mkdtemp's random part as XXXXXXXX
        run_dir = os.path.join(tempfile.gettempdir(), f"{RUN_PREFIX}{os.getpid()}-XXXXXXXX")
        shm_dir = (os.path.join(SHM_ROOT, f"{SHM_PREFIX}{os.getpid()}-XXXXXXXX")
                   if os.access(SHM_ROOT, os.W_OK) and shm_dir_wanted(args, flavour) else None)
    else:
        run_dir = make_run_dir()     # pool_dirs.py: those of launchers killed outright are removed first
        shm_dir = make_pool_shm_dir() if shm_dir_wanted(args, flavour) else None
    args.pid_file = os.path.join(run_dir, "rank0.pid")
    added = added_environment(args, flavour, run_dir, shm_dir)
    if args.dry_run:     # the exact command: what the launcher adds to the environment, then mpirun's command line
        print(shlex.join(["env", *(f"{k}={v}" for k, v in added.items()),
                          *build_command(args, placements, flavour, numactl)]))
        print("# XXXXXXXX: the random part of the directories the launcher makes at start and removes at the end")
        return 0
    env = dict(os.environ, **added)
    cmd = build_command(args, placements, flavour, numactl)
    # own session: terminal signals reach us, not mpirun; parent-death signal: if the launcher is
    # killed outright, mpirun gets SIGTERM and takes the ranks down instead of orphaning the pool
    outputs = [os.path.join(run_dir, name) for name in ("mpirun.out", "mpirun.err")]
    with open(outputs[0], "wb") as out, open(outputs[1], "wb") as err:
        proc = subprocess.Popen(dying_with_this_process(cmd), env=env, start_new_session=True, stdout=out,
                                stderr=err)
    watch = MpirunWatch(proc, *outputs)
    signal.signal(signal.SIGTERM, lambda *_: stop_pool(proc, args.pid_file))   # rank 0 shuts the pool down cleanly
    signal.signal(signal.SIGINT, lambda *_: stop_pool(proc, args.pid_file))
    # a pool ClientEngine spawned ends with the process that spawned it (owner_watch.py)
    owner = (OwnerWatch(args.owner_pid, args.owner_fd, lambda why: end_orphaned_pool(proc, args.pid_file, why))
             if args.owner_pid else None)
    try:
        return watch.wait()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)
        if owner is not None and owner.gone and args.owner_dir:   # nobody else is left to remove it
            shutil.rmtree(args.owner_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
