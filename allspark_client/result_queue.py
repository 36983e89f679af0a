"""ResultQueue: the per-request output channel, filled by an engine thread, read by callers.

Owns the buffered tokens, the request's GenerateRequestStatus and its timing stats. It is written
only through `_push` / `_set_status` (the engine loop or, for ClientEngine, the gRPC stream reader)
and is safe to read from any number of threads. It knows nothing about models or transport.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from allspark_client.types import GeneratedElements, GenerateRequestStatus, RequestStatInfo


def now_ms() -> int:
    return int(time.time() * 1000)


class ResultQueue:
    def __init__(self, context_length: int = 0):
        self._cond = threading.Condition()
        self._pending = GeneratedElements()
        self._has_new = False
        self._status = GenerateRequestStatus.Init
        self._generated_length = 0
        self._error: Optional[str] = None
        self._stats = RequestStatInfo(arrival_time=now_ms(), context_token_length=context_length)
        self._listener: Optional[Callable[[], None]] = None

    def _set_listener(self, fn: Optional[Callable[[], None]]) -> None:
        """fn() is called (on the writer's thread, quickly: it must not block) after every push and status change;
        an asyncio reader passes loop.call_soon_threadsafe(event.set) so a stream needs no thread of its own."""
        with self._cond:
            self._listener = fn

    # ---- reader side (DashInfer names) -------------------------------------------------------
    def GenerateStatus(self) -> GenerateRequestStatus:
        with self._cond:
            return self._status

    def GeneratedLength(self) -> int:
        with self._cond:
            return self._generated_length

    def RequestStatInfo(self) -> dict:
        with self._cond:
            return self._stats.dict()

    def ErrorMessage(self) -> Optional[str]:
        """Why the request ended in GenerateInterrupted / InternalError (None otherwise)."""
        with self._cond:
            return self._error

    def Get(self) -> Optional[GeneratedElements]:
        """Block until at least one new token or a terminal status; None once nothing is left."""
        return self._get(timeout_s=None)

    def GetWithTimeout(self, timeout_ms: int) -> Optional[GeneratedElements]:
        """As Get, but return None after `timeout_ms` without news."""
        return self._get(timeout_s=max(0.0, timeout_ms / 1000.0))

    def GetNoWait(self) -> Optional[GeneratedElements]:
        with self._cond:
            return self._take()

    def _wait_terminal(self, timeout_s: Optional[float] = None) -> bool:
        """Block until the request reached a terminal status; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._status.is_terminal, timeout_s)

    def _get(self, timeout_s: Optional[float]) -> Optional[GeneratedElements]:
        with self._cond:
            self._cond.wait_for(lambda: self._has_new or self._status.is_terminal, timeout_s)
            return self._take()

    def _take(self) -> Optional[GeneratedElements]:
        if not self._has_new:
            return None
        out, self._pending, self._has_new = self._pending, GeneratedElements(), False
        return out

    # ---- writer side (engine only) -----------------------------------------------------------
    def _push(self, elements: GeneratedElements, status: GenerateRequestStatus) -> None:
        now = now_ms()
        with self._cond:
            n = len(elements.ids_from_generate)
            if n:
                self._pending.extend(elements)
                self._has_new = True
                self._generated_length += n
                st = self._stats
                if not st.first_token_time:
                    st.first_token_time = now
                    st.time_to_first_token = now - st.arrival_time
                    st.context_cached_length = elements.prefix_cache_len
                    if st.time_to_first_token > 0:
                        st.context_tps = 1000.0 * st.context_token_length / st.time_to_first_token
                st.last_token_time = now
                st.generated_token_length = self._generated_length
                span_ms = now - st.first_token_time
                if span_ms > 0 and self._generated_length > 1:
                    st.generate_tps = 1000.0 * (self._generated_length - 1) / span_ms
            self._set_status_locked(status, now)
            self._cond.notify_all()
            if self._listener is not None:
                self._listener()

    def _set_status(self, status: GenerateRequestStatus, error: Optional[str] = None) -> None:
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._set_status_locked(status, now_ms())
            self._cond.notify_all()
            if self._listener is not None:
                self._listener()

    def _set_stats(self, stats: RequestStatInfo) -> None:
        """Replace the timing stats (ClientEngine: the server's numbers arrive with the last reply)."""
        with self._cond:
            self._stats = stats

    def _mark_scheduled(self) -> None:
        if self._stats.time_in_queue:   # every step after the first (only the engine thread writes it)
            return
        with self._cond:
            if not self._stats.time_in_queue:
                self._stats.time_in_queue = now_ms() - self._stats.arrival_time

    def _set_status_locked(self, status: GenerateRequestStatus, now: int) -> None:
        if self._status.is_terminal:
            return  # a terminal status is final
        self._status = status
        if status.is_terminal:
            self._stats.finished_time = now
