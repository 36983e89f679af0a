"""The only importer of mpi4py: rank/world queries and the collectives the engine uses.

`get_comm()` returns a `LocalComm` (every collective a no-op) for a single process and an `MpiComm`
when running under mpirun with more than one rank. Allreduce travels as fp32 (numpy has no bfloat16).
Every call must come from the rank's engine thread.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Optional

import torch


SPIN_AFTER_MESSAGE_S = 0.02   # a worker between steps spins this long before it starts napping
MIN_NAP_S, MAX_NAP_S = 0.0002, 0.005


class LocalComm:
    rank = 0
    world_size = 1

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_rows(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every rank's [N, local] shard along dim 1 at rank 0 (None elsewhere)."""
        return t

    def bcast(self, obj: Any) -> Any:
        return obj

    def allgather_obj(self, obj: Any) -> list:
        return [obj]

    def allreduce_min(self, value: int) -> int:
        return value

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        os._exit(code)


class MpiComm:
    def __init__(self):
        from mpi4py import MPI
        self._mpi = MPI
        self._c = MPI.COMM_WORLD
        self.rank = self._c.Get_rank()
        self.world_size = self._c.Get_size()

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        # GPU tensors are staged through host memory (correct, not fast: NCCL is to carry them)
        buf = t.detach().to("cpu", torch.float32).contiguous()
        self._c.Allreduce(self._mpi.IN_PLACE, buf.numpy(), op=self._mpi.SUM)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)
        return t

    def gather_rows(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        local = t.detach().to("cpu", torch.float32).contiguous()
        parts = self._c.gather(local.numpy(), root=0)
        if self.rank != 0:
            return None
        import numpy as np
        return torch.from_numpy(np.concatenate(parts, axis=-1))

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

    def barrier(self) -> None:
        self._c.Barrier()

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
