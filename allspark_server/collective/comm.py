"""The only importer of mpi4py and the only user of NCCL: rank/world queries and the collectives the engine uses.

`get_comm()` returns a `LocalComm` (every collective a no-op) for a single process and an `MpiComm`
when running under mpirun with more than one rank. Control (plans, objects) always travels over MPI. Host
tensors' allreduce travels over MPI as fp32 (numpy has no bfloat16); GPU tensors' allreduce, gather and broadcast
(the sampled ids of an overlapped decode step) go through NCCL (torch.distributed), set up by `use_gpu` with a
rendezvous address that rank 0 sends over MPI, except the allreduce of small tensors between the GPUs of one
host: a one-shot kernel over peer memory (cuda/peer_allreduce.py; ALLSPARK_PEER_ALLREDUCE=0 turns it off), which
can also add the residual and apply the next RMSNorm in the same launch (`allreduce_norm`).
Every call must come from the rank's engine thread.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Optional

import torch

from allspark_client import settings
from allspark_server.compute.device_kind import DeviceKind, in_host_memory

SPIN_AFTER_MESSAGE_S = 0.02   # a worker between steps spins this long before it starts napping
MIN_NAP_S, MAX_NAP_S = 0.0002, 0.005


class LocalComm:
    rank = 0
    world_size = 1

    def use_gpu(self, kind: DeviceKind) -> None:
        pass

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def allreduce_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """The residual add and RMSNorm of allreduce_(t) in one launch, as (normed, residual stream); None where
        this comm has no such launch for t (the caller then reduces and norms as two steps)."""
        return None

    def gather_rows(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every rank's [N, local] shard along dim 1 at rank 0 (None elsewhere)."""
        return t

    def bcast(self, obj: Any) -> Any:
        return obj

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's values of a tensor into every rank's tensor of the same shape and dtype, in place (GPU tensors
        by NCCL, host tensors by MPI)."""
        return t

    def allgather_obj(self, obj: Any) -> list:
        return [obj]

    def allreduce_min(self, value: int) -> int:
        return value

    def barrier(self, timeout_s: Optional[float] = None) -> bool:
        return True

    def abort(self, code: int = 1) -> None:
        os._exit(code)


class MpiComm:
    def __init__(self):
        from mpi4py import MPI
        self._mpi = MPI
        self._c = MPI.COMM_WORLD
        self.rank = self._c.Get_rank()
        self.world_size = self._c.Get_size()
        self._nccl = None   # torch.distributed, once use_gpu has set it up
        self._peer = None   # the one-shot allreduce over peer memory (cuda/peer_allreduce.py), GPUs of one host
        self._shard_widths: dict[int, list[int]] = {}

    def use_gpu(self, kind: DeviceKind) -> None:
        """Collective: start NCCL between the ranks' GPUs, `kind.device` on this rank (rank 0 picks a free TCP port
        for the rendezvous and broadcasts its address over MPI). Afterwards allreduce_ and gather_rows of GPU tensors
        use NCCL."""
        if self._nccl is not None:
            return
        import socket

        import torch.distributed as dist
        device = kind.device
        address = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                address = f"tcp://{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"
        address = self._c.bcast(address, root=0)
        dist.init_process_group("nccl", init_method=address, rank=self.rank, world_size=self.world_size,
                                device_id=device)
        self._nccl = dist
        # every rank decides alike (start is collective): wanted everywhere, all GPUs in one host, and each rank
        # seeing every GPU of the pool (the setup of benchmarks/results/pool-step-h100x2.json; ranks that
        # allspark-launch --gpus confines to their own GPU keep NCCL, which maps its peers by itself)
        want = settings.PEER_ALLREDUCE.get() and kind.visible_device_count() >= self.world_size
        wants = self._c.allgather((socket.gethostname(), want))
        if all(want for _, want in wants) and len({host for host, _ in wants}) == 1:
            from allspark_server.compute.cuda import peer_allreduce
            self._peer = peer_allreduce.start(device, self.rank, self.world_size, dist.group.WORLD.group_name,
                                              lambda ok: all(self._c.allgather(ok)),
                                              protocol=settings.PEER_ALLREDUCE_PROTOCOL.get())

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self._nccl is not None and not in_host_memory(t):
            if self._peer is not None and self._peer.fits(t):   # a decode step's rows: latency, not bytes
                return self._peer.allreduce_(t)
            self._nccl.all_reduce(t)
            return t
        # without NCCL, GPU tensors are staged through host memory (correct, not fast)
        buf = t.detach().to("cpu", torch.float32).contiguous()
        self._c.Allreduce(self._mpi.IN_PLACE, buf.numpy(), op=self._mpi.SUM)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)
        return t

    def allreduce_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if self._peer is not None and not in_host_memory(t):   # a decode step's rows, with the next norm
            return self._peer.allreduce_norm(t, residual, weight, eps)
        return None

    def gather_rows(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        if self._nccl is not None and not in_host_memory(t):   # padded to the widest shard, gathered, cut, joined
            widths = self._shard_widths.get(t.shape[-1])
            if widths is None:   # once per shape (all ranks ask together; a graph replay never comes here)
                widths = self._shard_widths[t.shape[-1]] = self._c.allgather(t.shape[-1])
            padded = torch.nn.functional.pad(t, (0, max(widths) - t.shape[-1]))
            parts = torch.empty((self.world_size,) + tuple(padded.shape), dtype=t.dtype, device=t.device)
            self._nccl.all_gather_into_tensor(parts, padded.contiguous())
            if self.rank != 0:
                return None
            return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)
        local = t.detach().to("cpu", torch.float32).contiguous()
        parts = self._c.gather(local.numpy(), root=0)
        if self.rank != 0:
            return None
        import numpy as np
        return torch.from_numpy(np.concatenate(parts, axis=-1))

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        if self._nccl is not None and not in_host_memory(t):
            self._nccl.broadcast(t, src=0)
            return t
        if not in_host_memory(t) or not t.is_contiguous():
            raise RuntimeError("broadcast_ takes contiguous host tensors, or GPU tensors once NCCL is up (use_gpu)")
        self._c.Bcast(t.numpy(), root=0)
        return t

    def bcast(self, obj: Any) -> Any:
        """Rank 0 sends `obj` to every rank. Non-root ranks wait without burning a core: they poll a
        non-blocking broadcast of the size, spinning only shortly after the previous message."""
        import numpy as np
        header = np.zeros(1, dtype=np.int64)
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            header[0] = len(payload)
            self._c.Ibcast(header, root=0).Wait()
            self._c.Bcast(np.frombuffer(payload, dtype=np.uint8).copy(), root=0)
            return obj
        req = self._c.Ibcast(header, root=0)
        deadline_spin = time.monotonic() + SPIN_AFTER_MESSAGE_S
        nap = MIN_NAP_S
        while not req.Test():
            if time.monotonic() > deadline_spin:
                time.sleep(nap)
                nap = min(nap * 2, MAX_NAP_S)
        buf = np.empty(int(header[0]), dtype=np.uint8)
        self._c.Bcast(buf, root=0)
        return pickle.loads(buf.tobytes())

    def allgather_obj(self, obj: Any) -> list:
        return self._c.allgather(obj)

    def allreduce_min(self, value: int) -> int:
        return self._c.allreduce(value, op=self._mpi.MIN)

    def barrier(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every rank has entered the barrier; False if that took longer than `timeout_s` (a rank
        dead or stopped). Always the non-blocking form, polled: a blocking Barrier would not match it."""
        req = self._c.Ibarrier()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        nap = MIN_NAP_S
        while not req.Test():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(nap)
            nap = min(nap * 2, MAX_NAP_S)
        return True

    def abort(self, code: int = 1) -> None:
        self._c.Abort(code)


_comm = None


def mpi_world_size_from_env() -> int:
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


def get_comm():
    global _comm
    if _comm is None:
        _comm = MpiComm() if mpi_world_size_from_env() > 1 else LocalComm()
    return _comm
