"""OpProfiler: one rank's op timings of one model, made at install when profiling is on (None when off).

CPU ranks time with perf_counter around the Python path's ops (the runner's inputs, the layer steps of the Python
loops, the LM head, sampling) while the native decode stack times its own ops in C++ (native/op_profile.h) into
`native`, merged in by `snapshot`. GPU ranks record CUDA events around each kernel group instead (what a graph
replay holds is one group); the events are read once the GPU has passed them, at the next step or the snapshot.
`add_step` times a whole step (the runner's execute; rank 0 adds its sampling), which the ops are parts of.
Off, the callers hold None and check it once per op group: no clock is read, no event recorded.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from allspark_client.op_profile_report import OpTiming, RankSteps
from allspark_server.compute import ops


class OpProfiler:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = "GPU ops: CUDA events" if self.cuda else "CPU ops: steady clock"
        self._ops: dict[str, list] = {}          # name -> [count, sum, min, max] in seconds
        self._pending: list[tuple] = []          # GPU: (name or None for the step, counts a step, start, end)
        self.steps = 0
        self.step_seconds = 0.0
        ext = None if self.cuda else ops.native()
        self.native = ext.OpProfile() if ext is not None else None    # the decode stack's ops (set_profile)

    def mark(self):
        """The start of an op: a perf_counter reading, or on a GPU a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, name: str, start, in_step: bool = False) -> None:
        """Op `name` ran from `start` (mark()) until now; `in_step`: its time is part of the step as well (rank 0's
        sampling, outside the runner's execute)."""
        if self.cuda:
            end = self.mark()
            self._pending.append((name, False, start, end))
            if in_step:
                self._pending.append((None, False, start, end))
            return
        seconds = time.perf_counter() - start
        self._record(name, seconds)
        if in_step:
            self.step_seconds += seconds

    def add_step(self, start) -> None:
        """A whole step ran from `start` until now."""
        if self.cuda:
            self._pending.append((None, True, start, self.mark()))
            return
        self.steps += 1
        self.step_seconds += time.perf_counter() - start

    def resolve(self, wait: bool = False) -> None:
        """GPU: count the ops whose events the GPU has passed (`wait`: all of them, waiting for the GPU). Without
        `wait` nothing waits, so a step still in flight (the overlapped loop) is not held up."""
        done = 0
        for name, counts, start, end in self._pending:
            if not wait and not end.query():
                break
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            if name is not None:
                self._record(name, seconds)
            else:
                self.steps += counts
                self.step_seconds += seconds
            done += 1
        del self._pending[:done]

    def _record(self, name: str, seconds: float) -> None:
        op = self._ops.get(name)
        if op is None:
            self._ops[name] = [1, seconds, seconds, seconds]
        else:
            op[0] += 1
            op[1] += seconds
            op[2] = min(op[2], seconds)
            op[3] = max(op[3], seconds)

    def snapshot(self, rank: int) -> tuple[list[OpTiming], RankSteps]:
        """This rank's ops (the decode stack's merged in by name) and steps, in milliseconds."""
        self.resolve(wait=True)
        merged = {name: list(v) for name, v in self._ops.items()}
        for name, count, total, low, high in (self.native.stats() if self.native is not None else ()):
            op = merged.setdefault(name, [0, 0.0, low, high])
            op[0] += count
            op[1] += total
            op[2], op[3] = min(op[2], low), max(op[3], high)
        rows = [OpTiming(rank, name, count, low * 1e3, high * 1e3, total * 1e3)
                for name, (count, total, low, high) in merged.items()]
        return rows, RankSteps(rank, self.steps, self.step_seconds * 1e3)


def timed(prof: Optional[OpProfiler], name: str, fn: Callable, *args):
    """fn(*args), timed as op `name` when profiling is on (`prof` not None)."""
    if prof is None:
        return fn(*args)
    start = prof.mark()
    out = fn(*args)
    prof.add(name, start)
    return out
