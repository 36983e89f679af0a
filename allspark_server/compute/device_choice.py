"""The one place a rank's device is chosen: its compute unit read into a DeviceKind (compute/device_kind.py), which
the rest of the rank asks what differs on it. A CPU rank never imports the CUDA backend."""
from __future__ import annotations

from typing import Union

import torch

from allspark_client.config import parse_compute_unit
from allspark_server.compute.device_kind import DeviceKind, HostDevice, in_host_memory


def rank_device_kind(compute_unit: str, rank: int) -> DeviceKind:
    """The device of `rank` for a compute unit such as 'CPU:0' or 'CUDA:0,1' (rank r takes the r-th id, made the
    current GPU); a clear error when the GPU is not there (compute/cuda/cuda_device.py: rank_gpu)."""
    unit, ids = parse_compute_unit(compute_unit)
    if unit == "CPU":
        return HostDevice(torch.device("cpu"))
    from allspark_server.compute.cuda.cuda_device import CudaDevice, rank_gpu
    return CudaDevice(rank_gpu(compute_unit, ids, rank))


def device_kind_of(device: Union[DeviceKind, torch.device, str]) -> DeviceKind:
    """The kind of a device given by name or torch.device (a DeviceKind is its own): host memory is the host's, any
    other device a GPU's. Touches no GPU (the tests ask a GPU's kind on CPU-only machines)."""
    if isinstance(device, DeviceKind):
        return device
    device = torch.device(device)
    if in_host_memory(device):
        return HostDevice(device)
    from allspark_server.compute.cuda.cuda_device import CudaDevice
    return CudaDevice(device)
