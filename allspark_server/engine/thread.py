"""EngineThread: the one thread per process that runs models and talks to the other ranks.

API threads post commands: request commands (add / stop) for a model, and `Call`s (install,
start, stop, release a model) whose result they wait for. The thread applies them, then gives
every started model with work one step. Being the only thread that steps models or broadcasts,
it keeps every collective on one thread per rank. When idle it sleeps on a condition variable.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from allspark_client.types import GenerateRequestStatus
from allspark_server.core.messages import ShutdownMsg
from allspark_server.engine.commands import AddRequest, StopRequest
from allspark_server.engine.served_model import ServedModel

log = logging.getLogger(__name__)

SHUTDOWN_ANSWER_S = 5.0   # how long rank 0 waits for the other ranks to acknowledge a shutdown


@dataclass
class Call:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


@dataclass
class ForModel:
    model_name: str
    command: Union[AddRequest, StopRequest]


class EngineThread:
    def __init__(self, comm, before_workers_exit: Optional[Callable[[], None]] = None):
        """`before_workers_exit`: called on this thread just before a shutdown tells the other ranks to exit."""
        self.comm = comm
        self._before_workers_exit = before_workers_exit
        self.models: dict[str, ServedModel] = {}        # mutated on this thread only
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="allspark-engine", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def post(self, item) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._inbox.append(item)
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        c = Call(fn)
        self.post(c)
        return c.future.result()

    def queued_requests(self, model_name: str) -> int:
        with self._cv:
            return sum(isinstance(i, ForModel) and i.model_name == model_name and isinstance(i.command, AddRequest)
                       for i in self._inbox)

    def shutdown(self) -> Optional[str]:
        """Tell the other ranks to exit, stop every request, end the thread. Returns None, or why the pool
        could not shut down cleanly (a rank that did not answer: its requests then end in InternalError)."""
        try:
            lost = self.call(self._shutdown_on_thread)
        except RuntimeError:      # already shutting down
            lost = None
        self._thread.join()
        return lost

    # ---- engine thread -----------------------------------------------------------------------
    def _shutdown_on_thread(self) -> Optional[str]:
        # The other ranks acknowledge first: a SIGTERM that mpirun sends because a rank died must not end
        # open streams as if they had finished normally.
        lost = None
        if self._before_workers_exit is not None:
            self._before_workers_exit()
        try:
            self.comm.bcast(ShutdownMsg())
            if not self.comm.barrier(SHUTDOWN_ANSWER_S):
                lost = (f"the pool lost a rank: the other {self.comm.world_size - 1} rank(s) did not answer "
                        f"its shutdown within {SHUTDOWN_ANSWER_S:.0f} s")
        except Exception as e:    # an MPI error: a peer is gone
            lost = f"the pool lost a rank: shutting down failed with {e!r}"
        if lost:
            log.error("%s", lost)
        for m in self.models.values():
            m.stop_all(error=lost)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        return lost

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._inbox or
                                  any(m.has_work for m in self.models.values()))
                items, self._inbox = list(self._inbox), deque()
                if self._stopping and not items:
                    return
            for item in items:
                self._dispatch(item)
            for model in list(self.models.values()):
                if model.has_work:
                    model.step()
            items = item = model = None   # idle until the next news: a released model must not live on here

    def _dispatch(self, item) -> None:
        if isinstance(item, Call):
            try:
                item.future.set_result(item.fn())
            except BaseException as e:   # the caller re-raises it
                item.future.set_exception(e)
            return
        model = self.models.get(item.model_name)
        if model is not None:
            model.apply(item.command)
        elif isinstance(item.command, StopRequest):
            item.command.done.set()
        else:   # the model went away between acceptance and now: never leave a reader waiting
            item.command.queue._set_status(GenerateRequestStatus.InternalError,
                                           f"model {item.model_name!r} was released")
