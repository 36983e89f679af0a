"""StepWatchdog: rank 0's guard against a pool step that never ends.

A rank that dies takes the MPI job down with it, but a rank that stops (SIGSTOP, a wedged driver, a host whose
network went away) leaves its peers blocked in a collective forever: no error reaches anyone. Each step of a
pool runs inside `watchdog.step(step_id, tokens)`; a thread checks the open step against a time limit and, past
it, calls `on_hang(message)`, which fails every open stream with that message and ends the pool non-zero, so
that clients see an error and systemd (Restart=on-failure) starts the pool again.

The limit is `timeout_s` when the operator sets one (`--step-timeout`); otherwise MARGIN_S beyond what the
slowest step so far predicts for this one: max(slowest step, tokens x slowest seconds per token), so a long
prefill after short decode steps is not mistaken for a hang. Until a step has finished the limit is at least
FIRST_STEP_S, whatever `timeout_s` says: the first step carries one-time work (memory first touched, lazy
initialisation, kernels compiled). The margin is 10 s rather than 1-2: a GPU rank may compile a Triton kernel
for a shape it meets for the first time inside a step, and a false alarm takes a whole pool down.

Time in which the watchdog's own thread did not run (a paused VM, a stopped rank 0, a machine so loaded that a
0.1 s sleep took seconds) is added to the open step's limit: the pool was stalled as a whole, not hung.

A stall must not raise the limit of the steps after it, so what a step teaches is bounded twice: the time in
which this process did not run is taken off its duration (also when the step ends before the watchdog's thread
woke to see it), and past the first step a step raises the slowest step (and seconds per token) to at most
GROWTH times what they were. A step that stalled on another rank (rank 1 stopped, then resumed within the
limit) is then a blip, not the new normal: steps that truly grow slower are learned within a few steps, each
of them still allowed MARGIN_S beyond the prediction.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

log = logging.getLogger(__name__)

MARGIN_S = 10.0
FIRST_STEP_S = 60.0
POLL_S = 0.1
STALL_S = 0.5          # a poll that wakes this much late means this process was not running
GROWTH = 2.0           # past the first step, one step raises what was learned by at most this factor


class StepWatchdog:
    def __init__(self, on_hang: Callable[[str], None], timeout_s: Optional[float] = None):
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"step timeout must be > 0 seconds, got {timeout_s}")
        self.on_hang = on_hang
        self.timeout_s = timeout_s
        self.slowest_s = 0.0
        self.slowest_per_token_s = 0.0
        self.steps_done = 0
        self._lock = threading.Lock()
        self._open: Optional[tuple[int, float, float]] = None     # (step id, started, limit)
        self._stalled_s = 0.0     # seconds the open step's process did not run (not learned from)
        self._woke = 0.0          # when the watchdog's thread last woke
        self._fired = False
        self._thread: Optional[threading.Thread] = None

    def limit(self, tokens: int) -> float:
        """Seconds the next step of `tokens` tokens may take."""
        if not self.steps_done:
            return max(FIRST_STEP_S, self.timeout_s or 0.0)
        if self.timeout_s is not None:
            return self.timeout_s
        return max(self.slowest_s, tokens * self.slowest_per_token_s) + MARGIN_S

    @contextmanager
    def step(self, step_id: int, tokens: int):
        if self._thread is None:
            self._woke = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="allspark-step-watchdog", daemon=True)
            self._thread.start()
        started = time.monotonic()
        with self._lock:
            self._open = (step_id, started, self.limit(tokens))
            self._stalled_s = 0.0
        try:
            yield
        finally:
            ended = time.monotonic()
            with self._lock:
                self._open = None
                # a stall the watchdog's thread has not woken to see yet (it may run after this thread resumes)
                late = ended - self._woke - POLL_S
                if late > STALL_S:
                    self._stalled_s += min(late, ended - started)
                    self._woke = ended
                self._learn(max(ended - started - self._stalled_s, 0.0), tokens)

    def _learn(self, took: float, tokens: int) -> None:
        """A step that ran `took` seconds (this process's stalls taken off) ended: the slowest step and seconds per
        token so far grow to it, by at most GROWTH times past the first step. Called under the lock."""
        per_token = took / max(tokens, 1)
        if self.steps_done:
            took = min(took, GROWTH * self.slowest_s)
            per_token = min(per_token, GROWTH * self.slowest_per_token_s)
        self.steps_done += 1
        self.slowest_s = max(self.slowest_s, took)
        self.slowest_per_token_s = max(self.slowest_per_token_s, per_token)

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(POLL_S)
            now = time.monotonic()
            with self._lock:
                late, self._woke = now - self._woke - POLL_S, now
                if self._open is None:
                    continue
                step_id, started, limit = self._open
                if late > STALL_S:            # we were not running: neither was the pool, do not count it
                    limit += late
                    self._stalled_s += min(late, now - started)
                    self._open = (step_id, started, limit)
                    log.warning("step watchdog: this process did not run for %.1f s; step %d's limit is now "
                                "%.1f s", late, step_id, limit)
                if now - started <= limit:
                    continue
                self._fired = True
            if not self.steps_done:
                how = "the first step's limit"
            elif self.timeout_s is not None:
                how = "--step-timeout"
            else:
                how = f"the slowest step so far took {self.slowest_s:.2f} s"
            message = f"pool step {step_id} did not finish within {limit:.1f} s ({how}): a rank has stopped or hangs"
            log.critical(message)
            self.on_hang(message)
