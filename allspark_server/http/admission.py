"""Admission control: at most `max_running` requests in the engine at once (a request of n choices counts n), at
most `max_queue` more waiting (first come, first served) for a slot; past that, Overloaded (the server answers 429
with Retry-After).

Runs on the event loop only (no locks). A slot is held from before start_request until the request is released,
so the engine never holds more than max_running of this server's requests. It knows nothing of HTTP.
"""
from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    pass


class Slot:
    """`weight` places of the admission (a request of n choices holds n), given back together."""

    def __init__(self, admission: "Admission", weight: int = 1):
        self._admission: "Admission | None" = admission
        self.weight = weight

    def release(self) -> None:
        """Give the places back (idempotent): to the waiters first in line, else to the pool of free places."""
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission._release(self.weight)


class Admission:
    def __init__(self, max_running: int, max_queue: int):
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running must be >= 1 and max_queue >= 0, got {max_running}, {max_queue}")
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0               # places held (a request of n choices holds n)
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    async def acquire(self, weight: int = 1) -> Slot:
        """`weight` places now, or after waiting in line (first come, first served: a request of many choices
        is not overtaken, and holds nothing while it waits); Overloaded when the line is full too."""
        if not 1 <= weight <= self.max_running:
            raise ValueError(f"a request may take 1 to {self.max_running} places, not {weight}")
        if self.running + weight <= self.max_running and not self.waiting:
            self.running += weight
            return Slot(self, weight)
        if self.waiting >= self.max_queue:
            raise Overloaded(f"{self.running} requests running and {self.waiting} waiting (limits "
                             f"{self.max_running} and {self.max_queue})")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, weight))
        try:
            await fut                      # _grant counted the places in `running` for us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(weight)      # the places arrived as we were cancelled: pass them on
            else:
                self._grant()              # a smaller request behind us may fit now
            raise
        return Slot(self, weight)

    def _release(self, weight: int) -> None:
        self.running -= weight
        self._grant()

    def _grant(self) -> None:
        """Hand free places to the waiters first in line, in order, as long as the first one fits."""
        while self._waiters:
            fut, weight = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.running + weight > self.max_running:
                return
            self._waiters.popleft()
            self.running += weight
            fut.set_result(None)
