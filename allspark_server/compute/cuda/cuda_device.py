"""CudaDevice: the DeviceKind of a GPU rank (compute/device_kind.py has what each trait means), and the choice of a
rank's GPU from its compute unit. Imports torch alone: it is made before anything touches the GPU."""
from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass
from typing import ClassVar

import torch

from allspark_client import settings
from allspark_server.compute.device_kind import DeviceKind

FLOAT8_MIN_CAPABILITY = (8, 9)    # e4m3 conversions in hardware (Triton's float8e4nv): Ada and newer


@dataclass(frozen=True)
class CudaDevice(DeviceKind):
    """A GPU rank: weights and KV cache in device memory, work queued on streams, decode steps in CUDA graphs."""
    captures_decode_graphs: ClassVar[bool] = True
    has_invariant_rows_mode: ClassVar[bool] = True
    kv_scratch_spans: ClassVar[int] = 1
    pins_host_tiers: ClassVar[bool] = True
    kv_budget_from_host_ram: ClassVar[bool] = False
    weights_in_hugepages: ClassVar[bool] = False
    sleep_frees_storages: ClassVar[bool] = True
    can_wake_from_host: ClassVar[bool] = True
    bandwidth_timed_on_device: ClassVar[bool] = True
    samples_on_host: ClassVar[bool] = False
    defers_delivery: ClassVar[bool] = True
    guided_masks_default: ClassVar[str] = "background"
    vision_forward_patches: ClassVar[int] = 65536
    collectives_use_nccl: ClassVar[bool] = True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached_memory(self) -> None:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)   # a workspace per stream that ran a GEMM
        if clear is not None:
            clear()
        gc.collect()
        torch.cuda.empty_cache()                # then every freed block goes back to the driver

    def free_memory_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free

    def pinned_host_arena(self, nbytes: int):
        from allspark_server.compute.cuda.host_arena import HostArena
        return HostArena(nbytes)

    def copy_to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The values on their way to pinned host memory, and an event recorded after the copy."""
        host = values.to("cpu", non_blocking=True)   # pinned: an asynchronous copy
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def copy_bandwidth_gbs(self) -> float:
        return gpu_copy_bandwidth_gbs(self.device)

    def visible_device_count(self) -> int:
        return torch.cuda.device_count()

    def float8_refusal(self) -> str | None:
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < FLOAT8_MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(self.device)} is of compute capability {major}.{minor}; fp8 "
                    f"needs {FLOAT8_MIN_CAPABILITY[0]}.{FLOAT8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
        return None


def gpu_copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The GPU's device-to-device copy GB/s (read + written), timed with CUDA events."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def rank_gpu(compute_unit: str, ids: list[int], rank: int) -> torch.device:
    """The GPU of `rank` among the compute unit's `ids` (rank r takes the r-th), made the current device; a clear
    error when it is not there. Under `allspark-launch --gpus` ($ALLSPARK_RANK_GPU set) the rank sees only its own
    GPU, as cuda:0: the compute unit must name that GPU for this rank."""
    launcher_gpu = settings.RANK_GPU.get()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        raise ValueError(f"compute_unit {compute_unit}: this process sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r})")
    if rank >= len(ids):
        raise ValueError(f"compute_unit {compute_unit} names {len(ids)} GPU(s) for a pool of more ranks (rank {rank})")
    if launcher_gpu is not None:
        if ids[rank] != launcher_gpu:
            raise ValueError(f"compute_unit {compute_unit} gives rank {rank} GPU {ids[rank]}, but allspark-launch "
                             f"gave this rank GPU {launcher_gpu} ({settings.RANK_GPU.name}={launcher_gpu}, "
                             f"CUDA_VISIBLE_DEVICES={visible!r}): name the launcher's GPUs in rank order")
        torch.cuda.set_device(0)   # the launcher's GPU is the only one this rank sees
        return torch.device("cuda", 0)
    if ids[rank] >= torch.cuda.device_count():
        raise ValueError(f"compute_unit {compute_unit}: GPU {ids[rank]} does not exist here "
                         f"({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(ids[rank])
    return torch.device("cuda", ids[rank])
