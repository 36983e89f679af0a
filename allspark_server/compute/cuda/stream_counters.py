"""Zeroed int32 counters for kernels whose programs count one another: the decode attention's split combine, the
grouped LoRA shrink's last program. Each launch leaves the counters it used at zero again, so one
buffer serves every launch of a stream, one after another (each counts only past its PDL wait, when the launch
before it has completed).

A buffer per (use, device, stream): a graph's warm-up on a side stream must not share counters with another
model's steps running meanwhile on the default stream. A graph being captured takes the default stream's buffer,
where DecodeGraphs replays it; that buffer is made by the warm-up before every capture (capture_each_size runs
each size eagerly first, the largest first). Buffers only grow: a larger one is made beside the old, which stays
alive, since captured graphs point at it."""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device, int], list[torch.Tensor]] = {}
_DEFAULT_STREAMS: dict[torch.device, int] = {}


def _big_enough(key, needed: int) -> bool:
    buffers = _BUFFERS.get(key)
    return bool(buffers) and buffers[-1].numel() >= needed


def stream_counters(use: str, device: torch.device, needed: int, minimum: int) -> torch.Tensor | None:
    """At least `needed` zeroed counters of `use` for launches on the current stream (at least `minimum` made at a
    time); None while a graph is captured and the default stream's buffer is smaller than `needed`."""
    default = stream = 0
    if device.type == "cuda":
        default = _DEFAULT_STREAMS.get(device)
        if default is None:
            default = _DEFAULT_STREAMS[device] = torch.cuda.default_stream(device).cuda_stream
        if torch.cuda.is_current_stream_capturing():
            return _BUFFERS[(use, device, default)][-1] if _big_enough((use, device, default), needed) else None
        stream = torch.cuda.current_stream(device).cuda_stream
    if _big_enough((use, device, stream), needed) and _big_enough((use, device, default), needed):
        return _BUFFERS[(use, device, stream)][-1]      # an eager step's launches: host time counts
    for key in {(use, device, default), (use, device, stream)}:
        buffers = _BUFFERS.setdefault(key, [])
        if not buffers or buffers[-1].numel() < needed:
            buffers.append(torch.zeros(max(minimum, 2 * needed), dtype=torch.int32, device=device))
    return _BUFFERS[(use, device, stream)][-1]
