"""A rank placing itself on its own host: the multi-host half of allspark-launch's placement.

On one host the launcher reads the topology and gives every rank its cores and NUMA node on the command line.
Across hosts it cannot: the hosts need not be alike, and their /sys is not the launcher's. There mpirun starts
`--place-on-host` ranks, as many per host as the host has NUMA nodes (`--map-by ppr:1:numa`) or as asked, and
each rank, before it joins MPI, reads its local rank among the ranks on its host (from the MPI launcher's
environment) and the topology of the host it runs on, takes its node's cores (or its share of them) and, where
numactl exists and the host has several nodes, re-executes itself under numactl so its memory stays on that
node. Every rank reports where it runs (`describe_placement`); rank 0 logs the pool's layout.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
from typing import Optional

from allspark_client import settings
from allspark_client.launch.rank_placement import RankPlacement, format_cpu_list, read_topology

# (local rank, ranks on this host) as Open MPI, MPICH/Hydra and plain PMIx launchers set them
LOCAL_RANK_ENV = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                  ("PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"))
PLACED_ENV = settings.PLACED.name      # set on the re-executed rank: it does not place itself twice


class PlacementError(RuntimeError):
    pass


def local_rank_and_size(env=None) -> tuple[int, int]:
    env = os.environ if env is None else env
    for rank_var, size_var in LOCAL_RANK_ENV:
        if rank_var in env and size_var in env:
            return int(env[rank_var]), int(env[size_var])
    raise PlacementError("--place-on-host needs the MPI launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, "
                         "MPI_LOCALRANKID or PMIX_LOCAL_RANK): start this rank with mpirun")


def place_on_host(local_rank: int, local_size: int, topo: dict[int, list[int]]) -> RankPlacement:
    """The node and cores of the `local_rank`-th of `local_size` ranks on a host with NUMA topology `topo`:
    fewer ranks than nodes take the first nodes whole; a multiple of the nodes splits each node's cores evenly."""
    nodes = sorted(topo)
    host = socket.gethostname()
    if not 0 <= local_rank < local_size:
        raise PlacementError(f"local rank {local_rank} is not within the {local_size} rank(s) on {host}")
    if local_size <= len(nodes):
        node = nodes[local_rank]
        return RankPlacement(node, tuple(topo[node]))
    if local_size % len(nodes):
        raise PlacementError(f"{local_size} ranks on host {host} do not divide over its {len(nodes)} NUMA "
                             f"node(s) {nodes}: run one rank per node (the launcher's default) or a multiple")
    per_node = local_size // len(nodes)
    node = nodes[local_rank // per_node]
    cpus = topo[node]
    if per_node > len(cpus):
        raise PlacementError(f"NUMA node {node} of host {host} has {len(cpus)} cpu(s), cannot host {per_node} ranks")
    size = len(cpus) // per_node
    j = local_rank % per_node
    return RankPlacement(node, tuple(cpus[j * size:(j + 1) * size]))


def numactl_argv(placement: RankPlacement, whole_node: bool, numactl: str, argv: list[str]) -> list[str]:
    """The command that runs `argv` with memory on the placement's node (and cores: the node's, or its share)."""
    bind = (["--cpunodebind", str(placement.node)] if whole_node
            else ["--physcpubind", format_cpu_list(placement.cpus)])
    return [numactl] + bind + ["--membind", str(placement.node)] + argv


def self_place(server_argv: list[str], env=None) -> Optional[str]:
    """Before MPI starts: pick this rank's cores; returns them as a --cpus list, or re-executes this process
    under numactl (never returns) when that keeps memory on the rank's node. None once already placed."""
    if settings.PLACED.get() if env is None else settings.PLACED.read(env):
        return None
    env = os.environ if env is None else env
    local_rank, local_size = local_rank_and_size(env)
    topo = read_topology()
    placement = place_on_host(local_rank, local_size, topo)
    cpus = format_cpu_list(placement.cpus)
    numactl = shutil.which("numactl")
    if numactl and len(topo) > 1:
        argv = [a for a in server_argv if a != "--place-on-host"] + ["--cpus", cpus]
        os.environ[PLACED_ENV] = "1"
        whole = len(placement.cpus) == len(topo[placement.node])
        cmd = numactl_argv(placement, whole, numactl, [sys.executable, "-m", "allspark_server"] + argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(numactl, cmd)
    return cpus


def describe_placement(rank: int, threads: int) -> str:
    """One line: where this rank runs (its host, the NUMA node(s) of its cores, the cores, threads)."""
    cpus = os.sched_getaffinity(0)
    nodes = [n for n, node_cpus in read_topology().items() if cpus & set(node_cpus)]
    where = f"NUMA node {','.join(map(str, nodes))}" if nodes else "no NUMA node"
    return f"rank {rank} on {socket.gethostname()}: {where}, cpus {format_cpu_list(cpus)}, {threads} threads"
