"""Admission control: at most `max_running` requests in the engine at once, at most `max_queue` more waiting
(first come, first served) for a slot; past that, Overloaded (the server answers 429 with Retry-After).

Runs on the event loop only (no locks). A slot is held from before start_request until the request is released,
so the engine never holds more than max_running of this server's requests. It knows nothing of HTTP.
"""
from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    pass


class Slot:
    def __init__(self, admission: "Admission"):
        self._admission: "Admission | None" = admission

    def release(self) -> None:
        """Give the slot back (idempotent): to the next waiter, else to the pool of free slots."""
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission._release()


class Admission:
    def __init__(self, max_running: int, max_queue: int):
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running must be >= 1 and max_queue >= 0, got {max_running}, {max_queue}")
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> Slot:
        """A slot now, or after waiting in line; Overloaded when the line is full too."""
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return Slot(self)
        if self.waiting >= self.max_queue:
            raise Overloaded(f"{self.running} requests running and {self.waiting} waiting (limits "
                             f"{self.max_running} and {self.max_queue})")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut                      # _release hands its slot over: `running` is unchanged
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()            # the slot arrived as we were cancelled: pass it on
            raise
        return Slot(self)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
