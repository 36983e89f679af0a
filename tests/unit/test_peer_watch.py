"""PeerWatch (rank 0's eye on the ranks of its own machine) against real processes: a running one, one killed and
reaped, a zombie, a pid whose start time does not match (a reused pid), a peer of another boot; the callback fires
once, naming the rank, and not after stand_down. The pool tests (test_pool_failures.py) kill real ranks."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time

from allspark_server.engine.peer_watch import PeerWatch, identity, is_alive


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_identity_and_liveness_of_real_processes():
    me = identity()
    assert me is not None and me.pid == os.getpid() and is_alive(me)
    child = sleeper()
    try:
        peer = identity(child.pid)
        assert peer is not None and (peer.boot_id, peer.pid_namespace) == (me.boot_id, me.pid_namespace)
        assert is_alive(peer)
        assert not is_alive(dataclasses.replace(peer, start_time=str(int(peer.start_time) + 1)))   # a reused pid
        child.send_signal(signal.SIGKILL)
        time.sleep(0.2)                 # not reaped yet: a zombie
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert not is_alive(peer)
        child.wait()                    # reaped: gone from /proc
        assert not is_alive(peer)
        assert identity(child.pid) is None
    finally:
        child.kill()
        child.wait()


def test_watch_reports_a_dead_peer_once_and_only_peers_it_can_see():
    me = identity()
    children = [sleeper(), sleeper()]
    try:
        elsewhere = dataclasses.replace(identity(children[1].pid), boot_id="another-machine")
        lost: list[str] = []
        called = threading.Event()
        watch = PeerWatch([me, identity(children[0].pid), elsewhere, None],
                          on_lost=lambda message: (lost.append(message), called.set()))
        assert list(watch.watched) == [1]        # rank 2 runs on another machine, rank 3 has no /proc
        time.sleep(0.3)
        assert not lost
        children[0].kill()
        assert called.wait(5.0)
        time.sleep(0.3)
        assert lost == [f"the pool lost rank 1: its process (pid {children[0].pid}) exited"]
    finally:
        for c in children:
            c.kill()
            c.wait()


def test_stand_down_stops_the_watch_before_workers_exit_on_purpose():
    child = sleeper()
    try:
        lost: list[str] = []
        watch = PeerWatch([identity(), identity(child.pid)], on_lost=lost.append)
        watch.stand_down()
        child.kill()
        child.wait()
        time.sleep(0.5)
        assert not lost
    finally:
        child.kill()
        child.wait()


def test_nothing_is_watched_without_identities():
    watch = PeerWatch([None, None], on_lost=lambda message: None)
    assert watch.watched == {}
