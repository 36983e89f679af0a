"""HostArena: host memory pinned for the GPU at its exact size, where a sleeping GPU rank's weights wait (residency)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class HostArena:
    """`nbytes` of host memory pinned for the GPU at its exact size (cudaHostRegister: torch's pinned allocator would
    round the request up to a power of two, up to twice the weights), unpinned before it is freed. Pageable memory
    where pinning fails (the copies are then slower, not wrong)."""

    def __init__(self, nbytes: int):
        self.bytes = torch.empty(nbytes, dtype=torch.uint8)
        try:
            self.pinned = _cudart_ok(torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), nbytes, 0))
        except Exception as e:   # no usable cudart binding: pageable memory still works
            log.info("cudaHostRegister: %s", e)
            self.pinned = False
        if not self.pinned:
            log.warning("cudaHostRegister of %d bytes failed: the weights wait in pageable host memory", nbytes)

    def __del__(self):
        if self.pinned:
            self.pinned = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            except Exception:   # the process is ending and CUDA with it
                pass


def _cudart_ok(result) -> bool:
    """A cudart call's result (an enum, an int or a tuple starting with one, by torch version) is cudaSuccess."""
    if isinstance(result, tuple):
        result = result[0]
    return int(getattr(result, "value", result)) == 0
