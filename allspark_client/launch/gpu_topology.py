"""GPU topology for allspark-launch: which GPUs this machine has and the NUMA node nearest each.

Asks nvidia-smi for each GPU's index and PCI bus id, then reads that PCI device's `numa_node` in
sysfs. Owns nothing else: placement is rank_placement.py's, the mpirun command mpirun_command.py's. Torch- and CUDA-free
(it runs before any rank); nvidia-smi and the sysfs root are parameters, so tests use fakes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

NO_NODE = -1   # sysfs's answer when the platform gives a device no NUMA affinity


def parse_gpu_list(text: str) -> Optional[list[int]]:
    """'0,1' -> [0, 1]; 'all' (or '') -> None, meaning every visible GPU. SystemExit on anything else."""
    text = text.strip()
    if text.lower() in ("", "all"):
        return None
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--gpus takes GPU indices like '0,1' or 'all', got {text!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise SystemExit(f"--gpus takes distinct GPU indices >= 0 like '0,1' or 'all', got {text!r}")
    return gpus


def sysfs_pci_address(bus_id: str) -> str:
    """nvidia-smi's '00000000:3B:00.0' -> sysfs's '0000:3b:00.0' (4-digit domain, lower case)."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def gpu_numa_nodes(gpus: Optional[list[int]] = None, sysfs_root: str = "/sys",
                   nvidia_smi: str = "nvidia-smi") -> dict[int, int]:
    """{GPU index: NUMA node nearest it} for `gpus` (None: every GPU nvidia-smi lists), in that order.

    Indices are nvidia-smi's (PCI bus order). The node is
    `<sysfs_root>/bus/pci/devices/<domain:bus:dev.fn>/numa_node`; NO_NODE (-1) when sysfs has no
    NUMA information for the device. SystemExit naming the problem when nvidia-smi is missing or
    fails, lists no GPU, or does not list a GPU asked for.
    """
    exe = shutil.which(nvidia_smi)
    if exe is None:
        raise SystemExit(f"allspark-launch --gpus: {nvidia_smi!r} not found (it lists the GPUs and their PCI bus "
                         f"ids): install the NVIDIA driver utilities or pass --nvidia-smi /path/to/nvidia-smi")
    try:
        out = subprocess.run([exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"allspark-launch --gpus: {exe} failed: {e}") from None
    if out.returncode != 0:
        raise SystemExit(f"allspark-launch --gpus: {exe} exited {out.returncode}: "
                         f"{(out.stdout + out.stderr).strip()[-500:]}")
    bus_ids: dict[int, str] = {}
    for line in filter(None, (ln.strip() for ln in out.stdout.splitlines())):
        index, _, bus_id = line.partition(",")
        try:
            bus_ids[int(index)] = sysfs_pci_address(bus_id)
        except ValueError:
            raise SystemExit(f"allspark-launch --gpus: cannot read {exe}'s line {line!r} "
                             f"(expected 'index, pci.bus_id')") from None
    if not bus_ids:
        raise SystemExit(f"allspark-launch --gpus: {exe} lists no GPU on this machine")
    wanted = sorted(bus_ids) if gpus is None else list(gpus)
    missing = [g for g in wanted if g not in bus_ids]
    if missing:
        raise SystemExit(f"allspark-launch --gpus: GPU(s) {missing} not found: {exe} lists "
                         f"{', '.join(map(str, sorted(bus_ids)))}")
    nodes = {}
    for g in wanted:
        try:
            with open(os.path.join(sysfs_root, "bus", "pci", "devices", bus_ids[g], "numa_node")) as f:
                nodes[g] = int(f.read().strip())
        except (OSError, ValueError):
            nodes[g] = NO_NODE
    return nodes


def visible_gpus(spec: str, environ=os.environ) -> Optional[list[int]]:
    """The GPUs `--gpus SPEC` names: its list, or for 'all' the indices in $CUDA_VISIBLE_DEVICES when that is
    set (read as nvidia-smi indices, the launcher's CUDA_DEVICE_ORDER=PCI_BUS_ID), else None (every GPU)."""
    gpus = parse_gpu_list(spec)
    if gpus is not None or "CUDA_VISIBLE_DEVICES" not in environ:
        return gpus
    visible = environ["CUDA_VISIBLE_DEVICES"].strip()
    try:
        gpus = parse_gpu_list(visible) if visible else []
    except SystemExit:
        gpus = None
    if not gpus:
        raise SystemExit(f"allspark-launch --gpus all: CUDA_VISIBLE_DEVICES={visible!r} names no GPU index "
                         f"(indices like '0,1' are needed): pass --gpus 0,1 or unset CUDA_VISIBLE_DEVICES")
    return gpus
