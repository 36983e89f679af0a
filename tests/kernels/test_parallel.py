"""allspark::parallel_for (native/parallel.cpp), how every native kernel splits its work: on allspark's
own workers (inside an OwnPoolScope, as in decode-stack steps with native GEMVs) or on ATen's OpenMP
threads (elsewhere), the same split either way; exceptions, nested, concurrent and forked callers, and
idle workers that sleep."""
from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time

import pytest
import torch

from allspark_client import settings
from allspark_server.compute import ops

pytestmark = pytest.mark.skipif(settings.NO_NATIVE.get(), reason="native path disabled")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("own_pool", [True, False])
@pytest.mark.parametrize("begin,end,grain", [(0, 1, 1), (0, 2, 1), (5, 22, 1), (0, 1000, 16), (3, 1000, 5000),
                                             (0, 7, 4), (10, 10, 1)])
def test_chunks_cover_the_range_like_aten(two_threads, begin, end, grain, own_pool):
    chunks = ops.native().parallel_chunks(begin, end, grain, -1, own_pool)
    n = end - begin
    expected_count = min(2, math.ceil(n / grain)) if n else 0
    assert len(chunks) == expected_count
    size = math.ceil(n / expected_count) if expected_count else 0
    for i, (b, e, on_caller, nested_inline) in enumerate(chunks):
        assert (b, e) == (begin + i * size, min(end, begin + (i + 1) * size))
        assert on_caller == (i == 0)       # the caller takes the first chunk, a worker the second
        # a parallel_for inside a pool chunk runs whole on that thread; after a single chunk (run by the
        # caller without the pool) it may use the pool itself
        assert nested_inline == (expected_count > 1)


@pytest.mark.parametrize("own_pool", [True, False])
def test_an_exception_in_a_worker_chunk_reaches_the_caller(two_threads, own_pool):
    with pytest.raises(RuntimeError, match=r"chunk \[50, 100\) failed"):
        ops.native().parallel_chunks(0, 100, 1, 77, own_pool)
    with pytest.raises(RuntimeError, match=r"chunk \[0, 50\) failed"):
        ops.native().parallel_chunks(0, 100, 1, 3, own_pool)
    assert len(ops.native().parallel_chunks(0, 100, 1, -1, own_pool)) == 2   # and the pool still works


def test_concurrent_callers_share_the_pool(two_threads):
    """Kernels release the GIL, so two threads may call them at once: the one that finds the pool busy
    runs its whole range itself. Every call must cover its range exactly once."""
    failures = []

    def hammer(i):
        for _ in range(2000):
            chunks = ops.native().parallel_chunks(0, 1000 + i, 1, -1, True)
            ran_itself = [c[:3] for c in chunks] == [(0, 1000 + i, True)]
            split = chunks == [(0, 500 + (i + 1) // 2, True, True), (500 + (i + 1) // 2, 1000 + i, False, True)]
            if not (ran_itself or split):
                failures.append(chunks)
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert failures == []


def _child_uses_the_pool(q):
    torch.set_num_threads(2)
    q.put(ops.native().parallel_chunks(0, 100, 1, -1, True))


def test_a_forked_child_gets_its_own_workers(two_threads):
    ops.native().parallel_chunks(0, 100, 1, -1, True)    # the parent's workers exist
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_uses_the_pool, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung in parallel_for (it waited for the parent's workers)")
    assert p.exitcode == 0 and q.get(timeout=5) == [(0, 50, True, True), (50, 100, False, True)]


def _process_cpu_ticks() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:   # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])   # utime + stime
    return total


def test_idle_workers_sleep(two_threads):
    """Workers spin only briefly after a region (parallel.cpp SPIN_US = 2 ms), then sleep: a process
    that ran kernels and then waits must not keep a core busy."""
    for _ in range(20):
        ops.native().parallel_chunks(0, 100, 1, -1, True)
    time.sleep(0.1)
    before = _process_cpu_ticks()
    time.sleep(1.0)
    used = _process_cpu_ticks() - before
    hz = os.sysconf("SC_CLK_TCK")
    assert used < 0.25 * hz, f"{used / hz:.2f} s of CPU in 1 s of idling: a worker keeps spinning"
