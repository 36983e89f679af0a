"""ClientSession: a ClientEngine's ownership link to its pool (the pool's side: allspark_server/pool/sessions.py).

The client picks a random session id, holds an Attach stream open under it for as long as it lives, and starts its
requests under it. When the client dies (or its connection drops and it does not come back within the pool's
grace), the stream ends and the pool releases the requests the client left unreleased. A thread attaches again
(same id) after a dropped connection. A pool that predates Attach answers UNIMPLEMENTED: the client then runs
without a session (its requests are released only by it, or by an operator's force). Torch-free.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Optional

import grpc

from allspark_client._proto import allspark_pb2 as pb

log = logging.getLogger("allspark.client")
REATTACH_PAUSE_S = 0.5


class ClientSession:
    def __init__(self, stub, timeout_s: float):
        self.id = uuid.uuid4().hex
        self._stub = stub
        self._closed = threading.Event()
        self._call: Optional[grpc.Call] = None
        self.release_after_s: Optional[float] = None
        try:
            self._attach(wait=False, timeout_s=timeout_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.id = ""                # a pool without sessions
            return
        threading.Thread(target=self._keep, name="allspark-session", daemon=True).start()

    def _attach(self, wait: bool, timeout_s: Optional[float] = None) -> None:
        call = self._stub.Attach(pb.AttachRequest(session_id=self.id), wait_for_ready=wait)
        self._call = call
        timer = None
        if timeout_s is not None:           # the first reply comes at once from a pool that answers Health
            timer = threading.Timer(timeout_s, call.cancel)
            timer.daemon = True
            timer.start()
        try:
            self.release_after_s = next(call).release_after_s
        finally:
            if timer is not None:
                timer.cancel()

    def _keep(self) -> None:
        """Holds the stream; after it ends (the connection dropped, the pool restarted), attaches again."""
        while not self._closed.is_set():
            try:
                for _ in self._call:
                    pass
            except grpc.RpcError:
                pass
            if self._closed.wait(REATTACH_PAUSE_S):
                return
            try:
                self._attach(wait=True)
            except (grpc.RpcError, StopIteration, ValueError):
                continue                    # the channel is closed (close()), or the pool not back yet

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
