"""Work beside the current CUDA stream: a kernel that needs only what the stream has already computed (a LoRA
shrink needs only the projection's input) runs on a side stream while the stream goes on (the projection's GEMM),
and the stream waits for it only where its result is read.

    with beside(device):      # the side stream first waits for everything launched so far on the current one
        launch_small_kernel()
    launch_big_kernel()       # on the current stream: the two run at once where the GPU has room
    join(device)              # the current stream waits for the side stream's work

Events order the two streams, so this holds in eager runs and in CUDA graph captures alike (a fork and a join in
the graph). A side stream per (device, current stream): two threads stepping on two streams never share one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    main = torch.cuda.current_stream(device)
    key = (main.device.index, main.cuda_stream)
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE[key] = torch.cuda.Stream(device=main.device)
    return side


@contextmanager
def beside(device: torch.device) -> Iterator[None]:
    """Launches in the block go to the side stream, after the current stream's work so far."""
    side = _side(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def join(device: torch.device) -> None:
    """The current stream's next launches wait for what `beside` launched."""
    torch.cuda.current_stream(device).wait_stream(_side(device))
