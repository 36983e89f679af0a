"""Image embeddings for many callers at once: requests that start together (thirty-two chats, each with an image)
have their images encoded in shared forwards of the vision tower instead of one by one.

Each caller queues the images it needs (by hash; an image already cached or already queued is not encoded again)
and waits. Whichever waiting caller finds the encoder free becomes the leader: it waits a few milliseconds while
images are still arriving, then takes queued images up to `max_patches` patches, runs one forward over them (images
never attend to each other, so each image's embeddings are what it would get alone), hands each its result, and
goes on while images are queued. The patch budget (by device: a GPU's forward of many images is short, a CPU's is
not) keeps each forward short, so the decode steps of running requests (on the engine thread) interleave between
forwards rather than wait for a whole burst of images.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Optional

import numpy as np
import torch

MAX_PATCHES = 16384          # patches a forward takes (a 2B model's 1344 x 1344 image is 9216)
GATHER_QUIET_S = 0.003       # a leader starts its first forward once no image arrived for this long ...
GATHER_MAX_S = 0.015         # ... or after this, so that requests arriving together share it
CACHED_IMAGES = 64           # images whose embeddings stay cached (least recently used go first)


class _Pending:
    __slots__ = ("key", "pixels", "grid", "done", "result", "error")

    def __init__(self, key: str, pixels: np.ndarray, grid: list[int]):
        self.key, self.pixels, self.grid = key, pixels, grid
        self.done = threading.Event()
        self.result: Optional[torch.Tensor] = None
        self.error: Optional[BaseException] = None


class ImageBatcher:
    """`encode(pixels [N, D], grid [n, 3]) -> embeddings [tokens, hidden]` is the tower's forward."""

    def __init__(self, encode: Callable, max_patches: int = MAX_PATCHES, cached: int = CACHED_IMAGES):
        self._encode, self.max_patches, self._cached = encode, max_patches, cached
        self._lock = threading.Lock()           # the queue, the pending table and the cache
        self._leader = threading.Lock()         # held by the caller running forwards
        self._queue: deque[_Pending] = deque()
        self._pending: dict[str, _Pending] = {}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.forwards = 0                       # forwards run (a count for tests and stats)

    def embed(self, images: list[tuple[str, np.ndarray, list[int]]]) -> list[torch.Tensor]:
        """The embeddings of each (hash, pixel rows, [t, h, w]) image, in order; raises what its forward raised."""
        waits: list = []
        with self._lock:
            for key, pixels, grid in images:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    waits.append(hit)
                    continue
                pending = self._pending.get(key)
                if pending is None:
                    pending = self._pending[key] = _Pending(key, pixels, grid)
                    self._queue.append(pending)
                waits.append(pending)
        for item in waits:
            if isinstance(item, _Pending):
                self._wait(item)
        return [item if isinstance(item, torch.Tensor) else item.result for item in waits]

    def _wait(self, pending: _Pending) -> None:
        while not pending.done.is_set():
            if self._leader.acquire(blocking=False):
                try:
                    self._drain()
                finally:
                    self._leader.release()
            else:
                pending.done.wait(0.002)
        if pending.error is not None:
            raise pending.error

    def _gather(self) -> None:
        """Wait (briefly) while images are still arriving: thirty-two requests started together reach the queue
        over some milliseconds, and one forward over all of them costs far less than several."""
        deadline, seen = time.monotonic() + GATHER_MAX_S, -1
        while time.monotonic() < deadline:
            with self._lock:
                queued = sum(len(p.pixels) for p in self._queue)
            if queued == seen or queued >= self.max_patches:
                return
            seen = queued
            time.sleep(GATHER_QUIET_S)

    def _drain(self) -> None:
        self._gather()
        while True:
            with self._lock:
                batch, patches = [], 0
                while self._queue and (not batch or patches + len(self._queue[0].pixels) <= self.max_patches):
                    batch.append(self._queue.popleft())
                    patches += len(batch[-1].pixels)
            if not batch:
                return
            try:
                grid = torch.tensor([p.grid for p in batch], dtype=torch.long)
                out = self._encode(torch.from_numpy(np.concatenate([p.pixels for p in batch])), grid)
                sizes = [int(np.prod(p.grid)) * len(out) // patches for p in batch]   # tokens of each image
                results, error = list(torch.split(out, sizes)), None
            except BaseException as e:          # every image of this forward fails with it
                results, error = [None] * len(batch), e
            self.forwards += 1
            with self._lock:
                for p, result in zip(batch, results):
                    p.result, p.error = result, error
                    del self._pending[p.key]
                    if error is None:
                        self._cache[p.key] = result
                while len(self._cache) > self._cached:
                    self._cache.popitem(last=False)
            for p in batch:
                p.done.set()
