"""A watch on this test process itself: a daemon thread that sleeps STEP_S and notes every wake-up that came
STALL_S or more late (the process, or its GIL, was not available to it), with the test running then, and gc's
callbacks timing every collection. pytest_terminal_summary prints what it saw, so a CI run whose tests about
running streams found them already ended tells why (stops 30 and 32: the pool ran on while this process did not)."""
from __future__ import annotations

import gc
import resource
import threading
import time

STEP_S = 0.05
STALL_S = 0.5


class StallWatch:
    def __init__(self):
        self.current = "(collection)"
        self.stalls: list[tuple[float, str, int]] = []   # (seconds late, test, major page faults meanwhile)
        self.gc_longest = (0.0, 0, "")                    # (seconds, generation, test)
        self.gc_total_s = 0.0
        self._gc_started = 0.0
        self._lock = threading.Lock()
        gc.callbacks.append(self._on_gc)
        threading.Thread(target=self._run, name="stall-watch", daemon=True).start()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        self.gc_total_s += took
        if took > self.gc_longest[0]:
            self.gc_longest = (took, info.get("generation", -1), self.current)

    def _run(self) -> None:
        while True:
            before, faults = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            time.sleep(STEP_S)
            late = time.monotonic() - before - STEP_S
            if late >= STALL_S:     # page faults that read from disk meanwhile tell a stall on I/O from one on CPU
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
                with self._lock:
                    self.stalls.append((late, self.current, faults))

    def report(self) -> list[str]:
        with self._lock:
            stalls = sorted(self.stalls, reverse=True)
        took, gen, test = self.gc_longest
        lines = [f"this process did not run for {STALL_S} s or more {len(stalls)} times"
                 + (f"; longest {stalls[0][0]:.1f} s ({stalls[0][2]} major page faults), in {stalls[0][1]}"
                    if stalls else ""),
                 f"gc: {self.gc_total_s:.1f} s in all; longest collection {took:.2f} s (generation {gen}) in {test}; "
                 f"{len(gc.get_objects())} objects tracked now"]
        lines += [f"  {late:.1f} s late ({faults} major page faults) in {where}"
                  for late, where, faults in stalls[1:10]]
        return lines
