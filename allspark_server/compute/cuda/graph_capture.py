"""CUDA graph capture of one step per batch size, and the event a replay's host-side copies are fenced with
(runner/cuda_graphs.py holds the step's inputs and replays what is captured here)."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

Out = TypeVar("Out")
_capture = threading.local()    # .running: capture_each_size runs in this thread, its warm-ups and captures


def for_a_graph() -> bool:
    """A step being captured, or run as the warm-up before its capture (which must take the capture's paths, so that
    its Triton kernels compile and its counters exist before the capture)."""
    return getattr(_capture, "running", False) or torch.cuda.is_current_stream_capturing()


def copies_done_event() -> torch.cuda.Event:
    """An event to record after a step's host-to-device copies: its query says they have read the host rows."""
    return torch.cuda.Event()


def capture_each_size(step: Callable[[int], Out], sizes: list[int]) -> tuple[dict[int, torch.cuda.CUDAGraph],
                                                                              dict[int, Out]]:
    """One graph of `step(b)` per batch size b of `sizes`, and each one's output: all in one memory pool, the
    largest captured first (the smaller ones fit in its blocks). Each size runs twice outside the graph first, on a
    side stream: Triton compiles, cuBLAS picks its kernels."""
    graphs, outputs = {}, {}
    pool = None
    stream = torch.cuda.Stream()
    _capture.running = True
    try:
        for b in sorted(sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):      # warm-up outside the graph: Triton compiles, cuBLAS picks
                for _ in range(2):
                    step(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[b] = step(b)
            pool = graph.pool()
            graphs[b] = graph
    finally:
        _capture.running = False
    torch.cuda.synchronize()
    return graphs, outputs
