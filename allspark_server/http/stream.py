"""Engine requests as asyncio streams: every open ResultQueue is read on the event loop, no thread per stream.

A ResultQueue (Engine's or ClientEngine's) is filled by another thread (the engine thread, or a ClientEngine
stream reader). Its listener hook (`ResultQueue._set_listener`) tells the event loop, without a thread of our
own: the writer thread, after each push, appends the stream to a "dirty" list and (only if no wake-up is pending
already) schedules one `loop.call_soon_threadsafe(drain)`; the drain reads just the dirty queues with GetNoWait()
and wakes their consumers. The writer's cost is a list append and a flag test; one wake-up serves a whole engine
step's pushes. A thread blocked in Get() per stream is what this avoids; run_in_executor would cap streams at the
pool's size.
Blocking control calls (start / release) run on the backend's small executor (backend.py), never here.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Optional

from allspark_client.types import GeneratedElements, GenerateRequestStatus

log = logging.getLogger("allspark.http")


class _Watch:
    """What the reader knows of one queue; read by its Generation."""
    __slots__ = ("queue", "items", "event", "done", "status", "error")

    def __init__(self, queue):
        self.queue = queue
        self.items: deque[GeneratedElements] = deque()
        self.event = asyncio.Event()
        self.done = False
        self.status = GenerateRequestStatus.Init
        self.error: Optional[str] = None

    def finish(self, status: GenerateRequestStatus, error: Optional[str]) -> None:
        if not self.done:
            self.done, self.status, self.error = True, status, error
            self.event.set()


class QueueReader:
    def __init__(self):
        self._listened: set[_Watch] = set()
        self._dirty: deque[_Watch] = deque()    # appended by writer threads, drained on the loop
        self._drain_pending = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def __len__(self) -> int:
        return len(self._listened)

    def watch(self, queue) -> _Watch:
        """Start reading `queue` (call on the event loop)."""
        self._loop = asyncio.get_running_loop()
        w = _Watch(queue)
        self._listened.add(w)
        queue._set_listener(lambda: self._notify(w))
        self._read(w)                            # what arrived before the listener was set
        return w

    def unwatch(self, w: _Watch) -> None:
        if w in self._listened:
            self._listened.discard(w)
            w.queue._set_listener(None)

    async def close(self) -> None:
        for w in list(self._listened):
            self.unwatch(w)
            w.finish(GenerateRequestStatus.InternalError, "the server is shutting down")

    def _notify(self, w: _Watch) -> None:
        """On the writer's thread, under the queue's lock: quick, never blocks, never raises."""
        self._dirty.append(w)
        if not self._drain_pending:
            self._drain_pending = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:                 # the loop is closed: the server is gone
                pass

    def _drain(self) -> None:
        self._drain_pending = False              # before reading: a push after this schedules another drain
        while self._dirty:
            w = self._dirty.popleft()
            if w in self._listened:
                self._read(w)

    def _read(self, w: _Watch) -> None:
        q = w.queue
        try:
            status = q.GenerateStatus()        # before GetNoWait: a terminal status means nothing more will come
            el = q.GetNoWait()
        except Exception as e:                 # a broken queue ends its stream, never the reader
            log.exception("reading a result queue failed")
            self.unwatch(w)
            w.finish(GenerateRequestStatus.InternalError, f"reading the result queue failed: {e!r}")
            return
        if el is not None and el.ids_from_generate:
            w.items.append(el)
            w.event.set()
        if status.is_terminal:
            self.unwatch(w)
            w.finish(status, q.ErrorMessage())


class Generation:
    """One started engine request, read as an async sequence of GeneratedElements (`next()` -> None at the end;
    then `status` and `error` say how it ended). `close()` releases the request on the engine, at once and
    without waiting (idempotent): call it whatever happened."""

    def __init__(self, backend, handle, queue, reader: QueueReader):
        self._backend, self.handle, self._reader = backend, handle, reader
        self._watch = reader.watch(queue)
        self._closed = False

    async def next(self) -> Optional[GeneratedElements]:
        w = self._watch
        while True:
            if w.items:
                out = w.items.popleft()
                while w.items:
                    out.extend(w.items.popleft())
                return out
            if w.done:
                return None
            w.event.clear()
            await w.event.wait()

    @property
    def status(self) -> GenerateRequestStatus:
        return self._watch.status

    @property
    def error(self) -> Optional[str]:
        return self._watch.error

    def abort(self, reason: str) -> None:
        """End the stream now (the client left): next() returns what was read, then None."""
        self._reader.unwatch(self._watch)
        self._watch.finish(GenerateRequestStatus.GenerateInterrupted, reason)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reader.unwatch(self._watch)
            self._backend.release_soon(self.handle)
