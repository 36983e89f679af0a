"""What differs between the devices a rank can run on, named by why it differs: `DeviceKind` and the host's.

A rank's device is chosen once (compute/device_choice.py) into one DeviceKind: the torch device, the traits that
tell the rest of the rank which way to go (capture decode graphs or not, where the KV budget comes from, how
sleep frees memory, ...) and the few calls whose body is the device's own (synchronize, free cached memory,
time a copy). Code outside compute/ asks it by those names, never the device's type. `in_host_memory` answers
the one question left where only a tensor is at hand: whether it lives in host memory. The GPU's kind is
compute/cuda/cuda_device.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch


def in_host_memory(x: Union[torch.Tensor, torch.device]) -> bool:
    """Whether a tensor (or every tensor of a device) lives in host memory: numpy, madvise and huge pages reach it,
    and a copy to it from there is an ordinary memcpy."""
    return x.is_cpu if isinstance(x, torch.Tensor) else x.type == "cpu"


@dataclass(frozen=True)
class DeviceKind:
    """One rank's device and what differs on it. The traits (class constants of each kind):

    captures_decode_graphs   decode-only steps can replay CUDA graphs (runner/cuda_graphs.py; ALLSPARK_CUDA_GRAPHS
                             and a dense model decide whether they do)
    kv_scratch_spans         spans the KV cache holds past those the span manager hands out: where the graphs'
                             padding rows write
    pins_host_tiers          the prefix cache's host slots are pinned, so copies to and from the device are async
    kv_budget_from_host_ram  the KV cache is host RAM that the machine's ranks and models share (runner/kv_budget.py);
                             else it takes a share of the device memory left free (free_memory_bytes)
    weights_in_hugepages     the weights are host RAM, read into one huge-page arena (loader/rank_weights.cpu_state);
                             else each slice is read straight into tensors on the device
    sleep_frees_storages     sleep frees the storages under the weights and the KV cache (wake allocates them again,
                             at new addresses: graphs are captured again); else their pages go back to the OS in
                             place, at the same addresses, which the native decode stack keeps pointing at
    can_wake_from_host       the weights can wait for a wake in a pinned host copy (wake_from "host"): they live
                             apart from host memory
    bandwidth_timed_on_device  the decode's memory bandwidth is a device-to-device copy timed by the device
                             (copy_bandwidth_gbs); else a host copy in huge pages (runner/memory_bandwidth.py)
    samples_on_host          a step's logits are host tensors: the sampler draws with each request's seeded torch
                             generator and takes numpy's argmax; else counter-based draws, results copied back
    defers_delivery          a step's tokens reach their queues once the next step is launched: the consumers they
                             wake take the GIL while the device computes
    guided_masks_default     where guided-output masks are computed unless ALLSPARK_GUIDED_MASKS says: "background"
                             (a worker thread, while the device runs the step) or "inline" (before the step: no core
                             is free during it)
    collectives_use_nccl     the pool's tensor collectives run over NCCL between the ranks' devices (comm.use_gpu)
    vision_forward_patches   image patches one forward of a vision tower takes (engine/image_batcher.py): a GPU's
                             forward over many images is short, a CPU's is not (running decodes wait for it)
    has_invariant_rows_mode  row_mode.invariant_rows selects kernels here (a GPU's tensor-core GEMV), which a
                             speculating model's runner turns on; a CPU's alone-rows kernels are invariant already
    """
    device: torch.device

    captures_decode_graphs: ClassVar[bool]
    has_invariant_rows_mode: ClassVar[bool]
    kv_scratch_spans: ClassVar[int]
    pins_host_tiers: ClassVar[bool]
    kv_budget_from_host_ram: ClassVar[bool]
    weights_in_hugepages: ClassVar[bool]
    sleep_frees_storages: ClassVar[bool]
    can_wake_from_host: ClassVar[bool]
    bandwidth_timed_on_device: ClassVar[bool]
    samples_on_host: ClassVar[bool]
    defers_delivery: ClassVar[bool]
    guided_masks_default: ClassVar[str]
    vision_forward_patches: ClassVar[int]
    collectives_use_nccl: ClassVar[bool]

    def synchronize(self) -> None:
        """Wait until the device has finished the work queued on it."""

    def release_cached_memory(self) -> None:
        """Hand the memory that freed tensors leave cached back to the system (after sleep freed the storages)."""

    def free_memory_bytes(self) -> int:
        """Device memory free now (the auto KV budget of a kind without kv_budget_from_host_ram)."""
        raise NotImplementedError(f"{type(self).__name__} has no memory of its own apart from host RAM")

    def pinned_host_arena(self, nbytes: int):
        """`nbytes` of host memory the device copies to and from asynchronously (the weights of a sleeping rank)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no host copy: its memory is host memory")

    def copy_to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """`values` on their way to host memory and what to wait on before reading them there (None: nothing)."""
        return values, None

    def copy_bandwidth_gbs(self) -> float:
        """GB/s of a device-to-device copy (read + written), for bandwidth_timed_on_device kinds."""
        raise NotImplementedError(f"{type(self).__name__}: host RAM's copy is timed by runner/memory_bandwidth.py")

    def visible_device_count(self) -> int:
        """Devices of this kind the process sees (a pool's ranks that see every one can share peer memory)."""
        return 0

    def float8_refusal(self) -> Optional[str]:
        """Why fp8 (e4m3) weights cannot be served here, or None where they can."""
        return "this rank runs on a CPU, whose kernels have no fp8 path"


@dataclass(frozen=True)
class HostDevice(DeviceKind):
    """A CPU rank: every tensor in host RAM, the native kernels, nothing queued (synchronize has nothing to wait on)."""
    captures_decode_graphs: ClassVar[bool] = False
    has_invariant_rows_mode: ClassVar[bool] = False
    kv_scratch_spans: ClassVar[int] = 0
    pins_host_tiers: ClassVar[bool] = False
    kv_budget_from_host_ram: ClassVar[bool] = True
    weights_in_hugepages: ClassVar[bool] = True
    sleep_frees_storages: ClassVar[bool] = False
    can_wake_from_host: ClassVar[bool] = False
    bandwidth_timed_on_device: ClassVar[bool] = False
    samples_on_host: ClassVar[bool] = True
    defers_delivery: ClassVar[bool] = False
    guided_masks_default: ClassVar[str] = "inline"
    vision_forward_patches: ClassVar[int] = 4096
    collectives_use_nccl: ClassVar[bool] = False
