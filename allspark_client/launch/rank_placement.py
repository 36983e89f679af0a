"""Where allspark-launch puts each rank on this host: the NUMA topology (/sys, psutil's affinity, or an override),
the ISA flags it reports, and the placement of ranks on nodes and cores (one per NUMA node, several splitting a
node's cores, or one per GPU on that GPU's node). Torch-free; the mpirun command built from the placements is in
mpirun_command.py.
"""
from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

from allspark_client.cpu_features import cpu_flags
from allspark_client.launch.gpu_topology import NO_NODE


@dataclass(frozen=True)
class RankPlacement:
    node: int                   # NO_NODE (-1): not NUMA-pinned
    cpus: tuple[int, ...]       # cores for the rank's compute threads
    gpu: Optional[int] = None   # GPU ranks: the one GPU this rank sees (nvidia-smi index)


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
