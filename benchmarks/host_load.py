"""How busy the host is around a timed round: cores other processes and the hypervisor (steal) took over an
interval, and waiting for a quiet window before one (gguf_race.py and the scripts built on it)."""
from __future__ import annotations

import os
import time


class CpuMeter:
    """Cores used over an interval by other processes (all busy time less this process's) and by steal."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = v[0] + v[1] + v[2] + v[5] + v[6]         # user nice system irq softirq
        t = os.times()
        return time.perf_counter(), busy / self.hz, t.user + t.system, v[7] / self.hz

    def cores(self) -> dict:
        (w0, b0, o0, s0), (w1, b1, o1, s1) = self.start, self._read()
        wall = w1 - w0
        return {"others_cores": max(0.0, (b1 - b0) - (o1 - o0)) / wall, "steal_cores": (s1 - s0) / wall}


def wait_quiet(max_cores: float, timeout_s: float, window_s: float = 10.0) -> dict:
    """Wait (at most `timeout_s`) for a `window_s` window in which other processes used under `max_cores`;
    the last window's cores and how long it waited."""
    t0 = time.perf_counter()
    while True:
        meter = CpuMeter()
        time.sleep(window_s)
        cores = meter.cores()
        if cores["others_cores"] < max_cores or time.perf_counter() - t0 > timeout_s:
            return {"quiet_window_others_cores": cores["others_cores"], "waited_s": time.perf_counter() - t0}
