"""Sessions: which client owns the pool's finished requests, so that a client that dies does not pin them for good.

A client holds an Attach stream open while it lives (its session, an id it chose) and starts its requests under that
id. A request whose stream ended delivered (the client has its last reply) is the client's to release; if the client
dies first, or loses its connection and does not come back, no Attach of its session stays open, and once none has
been for `grace_s` the session's requests still live are released. A client that comes back within the grace (the
same id on a new connection) keeps them. (A request cut off mid-stream is released at once by the Generate stream
itself.) Used on the servicer's event loop thread only.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional

from allspark_client.types import RequestHandle

MAX_SESSION_ID = 128


@dataclass
class _Session:
    attached: int = 0                                        # open Attach streams
    handles: dict[tuple[str, int], RequestHandle] = field(default_factory=dict)
    expiry: Optional[asyncio.TimerHandle] = None


class Sessions:
    def __init__(self, grace_s: float, release: Callable[[RequestHandle, float], None]):
        """`release(handle, grace_s)`: called for each request of a session whose client is gone (it must not
        block: the servicer hands the release to its call pool)."""
        self.grace_s = grace_s
        self._release = release
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[tuple[str, int], str] = {}

    @staticmethod
    def valid(session_id: str) -> bool:
        return 0 < len(session_id) <= MAX_SESSION_ID

    def attach(self, session_id: str) -> None:
        s = self._sessions.setdefault(session_id, _Session())
        s.attached += 1
        if s.expiry is not None:          # the client is back within the grace
            s.expiry.cancel()
            s.expiry = None

    def detach(self, session_id: str) -> None:
        s = self._sessions.get(session_id)
        if s is None:
            return
        s.attached -= 1
        if s.attached == 0:
            s.expiry = asyncio.get_running_loop().call_later(self.grace_s, self._expire, session_id)

    def own(self, session_id: str, handle: RequestHandle) -> None:
        """`handle` was started under `session_id`."""
        key = (handle.model_name, handle.request_id)
        self._sessions.setdefault(session_id, _Session()).handles[key] = handle
        self._owner[key] = session_id

    def forget(self, model_name: str, request_id: int) -> None:
        """The request was released (by its client or otherwise)."""
        session_id = self._owner.pop((model_name, request_id), None)
        s = self._sessions.get(session_id) if session_id is not None else None
        if s is not None:
            s.handles.pop((model_name, request_id), None)

    def forget_model(self, model_name: str) -> None:
        for key in [k for k in self._owner if k[0] == model_name]:
            self.forget(*key)

    def _expire(self, session_id: str) -> None:
        s = self._sessions.get(session_id)
        if s is None or s.attached:
            return
        del self._sessions[session_id]
        for key, handle in s.handles.items():
            self._owner.pop(key, None)
            self._release(handle, self.grace_s)

    def owned(self) -> int:
        """Requests held by sessions (for tests and logs)."""
        return len(self._owner)
