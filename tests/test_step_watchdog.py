"""StepWatchdog (allspark_server/step_watchdog.py): its time limits worked by hand, and that it calls on_hang
for a step past its limit and not for one within it."""
from __future__ import annotations

import threading
import time

import pytest

from allspark_server.engine import step_watchdog as sw


def test_limits():
    dog = sw.StepWatchdog(lambda message: None)
    assert dog.limit(10) == sw.FIRST_STEP_S                     # nothing measured yet
    with dog.step(1, 4):                                        # a 4-token step of ~0.2 s: 0.05 s a token
        time.sleep(0.2)
    assert 0.2 <= dog.slowest_s < 0.5 and dog.slowest_per_token_s == pytest.approx(dog.slowest_s / 4)
    assert dog.limit(1) == pytest.approx(dog.slowest_s + sw.MARGIN_S)
    assert dog.limit(400) == pytest.approx(100 * dog.slowest_s + sw.MARGIN_S)   # a long prefill: 400 x 0.05 s
    fixed = sw.StepWatchdog(lambda m: None, timeout_s=3)
    assert fixed.limit(10_000) == sw.FIRST_STEP_S               # the first step carries one-time work
    with fixed.step(1, 1):
        pass
    assert fixed.limit(10_000) == 3
    with pytest.raises(ValueError, match="step timeout"):
        sw.StepWatchdog(lambda m: None, timeout_s=0)


def test_fires_past_the_limit_only():
    fired: list[tuple[float, str]] = []
    done = threading.Event()

    def on_hang(message):
        fired.append((time.monotonic(), message))
        done.set()
    dog = sw.StepWatchdog(on_hang, timeout_s=0.5)
    with dog.step(1, 1):
        time.sleep(0.3)                                          # within the limit
    time.sleep(0.3)
    assert not fired
    began = time.monotonic()
    with dog.step(2, 1):
        assert done.wait(3.0)                                    # a step that does not end
    at, message = fired[0]
    assert 0.5 <= at - began < 0.5 + 5 * sw.POLL_S
    assert "step 2 did not finish within 0.5 s" in message and "--step-timeout" in message
    assert len(fired) == 1


class FakeClock:
    """time.monotonic/time.sleep for the watchdog's module: sleep(s) advances the clock by s, plus a stall
    (seconds the process did not run) when one is queued."""
    def __init__(self):
        self.now = 1000.0
        self.stalls: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        time.sleep(0.005)
        self.now += s + (self.stalls.pop(0) if self.stalls else 0.0)


@pytest.mark.parametrize("stall_s", [0.0, 2.0])
def test_time_the_process_did_not_run_is_not_counted(monkeypatch, stall_s):
    """timeout 0.5 s, a step that never ends. Without a stall it fires when 0.5 s have passed; a 2 s stall of the
    watchdog's thread (its 0.1 s poll woke 2 s late) moves the limit to 2.5 s."""
    clock = FakeClock()
    monkeypatch.setattr(sw, "time", clock)
    fired: list[tuple[float, str]] = []
    done = threading.Event()

    def on_hang(message):
        fired.append((clock.now, message))
        done.set()
    dog = sw.StepWatchdog(on_hang, timeout_s=0.5)
    with dog.step(1, 1):                                        # the first step: instant
        pass
    with dog.step(2, 1):
        # when the watchdog says step 2 began: the clock moves with its thread's polls, so a read of it here or
        # before the step could already be some polls off on a loaded machine; and the stall queued only now,
        # while the step is open (queued before it, a poll between the steps could take it)
        began = dog._open[1]
        clock.stalls = [stall_s] if stall_s else []
        assert done.wait(5.0)
    at, message = fired[0]
    limit = 0.5 + stall_s
    assert limit <= at - began < limit + 2 * sw.POLL_S + 1e-9, (at - began, message)
    assert f"step 2 did not finish within {limit:.1f} s" in message
