"""A pool's clients and streams: its idle CPU use, a second client process alongside this one (and that
process's death mid-stream), 300 streams at once, and the stream limit (--max-streams) refusing streams as
overload while the pool serves on. Hostile input and bind rules: tests/pool/test_pool_grpc.py. Pools come from
`new_pool` (one per test, every process killed at teardown) or the session's `pool`."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings

import pytest
from client_scripts import CLIENT_SCRIPT, CLOSE_LIMIT_S, DYING_CLIENT_SCRIPT
from helpers import LONG_RUN_MAX_LENGTH, LONG_RUN_TOKENS, assert_same_tokens, collect, hf_greedy, hf_ref, random_prompt
from pool_helpers import (
    MODEL,
    PREMISE_TRIES,
    REDO_SPOILED,
    REPO,
    PremiseSpoiled,
    client_greedy,
    greedy_cfg,
    install,
    read_at_least,
    repo_env,
    start_running_streams,
    stop_and_release,
    wait_until,
)

from allspark_client import GenerateRequestStatus
from allspark_client.types import AsStatus


# ---- 1. an idle pool does not burn its cores ------------------------------------------------------
def test_idle_pool_uses_little_cpu(new_pool, loader):
    pool = new_pool()
    client = pool.client()
    install(client, loader)
    assert len(client_greedy(client, random_prompt(8, seed=41), 16)) == 16
    ranks = pool.ranks()
    assert len(ranks) == 2
    time.sleep(0.5)          # past the workers' short spin after the last message

    def cpu() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in ranks]

    # three windows of 1.5 s: a pool that polls or spins while idle uses CPU in every one of them; a passing
    # disturbance (a collection, page reclaim after the previous test's large caches) in one only, which once took
    # a full run's single 3 s window to 0.38 s against 0.06-0.07 s alone
    windows = []
    for _ in range(3):
        before, t0 = cpu(), time.monotonic()
        time.sleep(1.5)
        after, elapsed = cpu(), time.monotonic() - t0
        windows.append([a - b for a, b in zip(after, before)])
        print(f"idle pool: {elapsed:.2f}s wall, rank cpu (user+system) {[f'{u:.3f}s' for u in windows[-1]]}, "
              f"{100 * sum(windows[-1]) / elapsed / 2:.1f}% of 2 cores")
    assert min(sum(w) for w in windows) < 0.15, windows
    # and it still serves afterwards
    assert len(client_greedy(client, random_prompt(8, seed=42), 4)) == 4


# ---- 2. two client processes on one pool ----------------------------------------------------------
@REDO_SPOILED
def test_second_client_process_alongside(new_pool, loader, llama):
    pool = new_pool()
    client = pool.client()
    # our long request must outlast the other process's whole run (one CI run saw it end first): 4x the usual
    # long request (8000 tokens take ~5 s here); it is stopped as soon as the other's results are in, so it
    # costs no time
    install(client, loader, max_length=4 * LONG_RUN_MAX_LENGTH)
    mine = random_prompt(9, seed=51)
    theirs = [random_prompt(6, seed=52), random_prompt(11, seed=53)]
    n_theirs = 24

    env = repo_env()
    # -X faulthandler: a crash prints every thread's stack
    other = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", CLIENT_SCRIPT, pool.address,
                              json.dumps(theirs), str(n_theirs), str(CLOSE_LIMIT_S)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, cwd=REPO)
    try:
        # the other process pays its start-up (imports, connecting) before anything of ours runs, so the overlap
        # below does not depend on how fast this machine starts Python
        early = []                        # anything printed before (warnings share the pipe)
        for line in other.stdout:
            if line.strip() == "CONNECTED":
                break
            early.append(line)
        else:
            pytest.fail("the other client exited before connecting:\n" + "".join(early))
        # a long request of ours runs the whole time the other process works
        status, handle, queue = client.start_request(MODEL, {"input_ids": mine}, greedy_cfg(4 * LONG_RUN_TOKENS))
        assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
        tokens = read_at_least(queue, 2)
        other.stdin.write("go\n")
        other.stdin.flush()
        # and a short one of ours while the other process streams
        short = client_greedy(client, theirs[0], n_theirs)
        printed = []                      # the other's output up to its results (not its exit, which can lag)
        for line in other.stdout:
            printed.append(line)
            if line.startswith("RESULT "):
                break
        ours_then = (queue.GenerateStatus(), queue.GeneratedLength(), queue.ErrorMessage())
        # the rest through the same buffered reader: what it already holds ("CLOSED" can come in the read that
        # brought "RESULT") would be lost to communicate(), which reads the pipe's descriptor itself
        other.stdin.close()
        reader = threading.Thread(target=lambda: printed.extend(other.stdout), daemon=True)
        reader.start()
        try:
            other.wait(timeout=CLOSE_LIMIT_S + 30)
            exited = True
        except subprocess.TimeoutExpired:   # close() returned, or its stacks were printed, but Python has not ended
            other.kill()
            other.wait()
            exited = False
        reader.join(timeout=10)
        out = "".join(printed)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    overlapped = not ours_then[0].is_terminal
    assert client.stop_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS
    rest, _, final = collect(queue, timeout_s=30)
    tokens += rest
    assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS

    assert "CLOSED" in out, (f"the other client's close() did not return within {CLOSE_LIMIT_S} s (exit status "
                             f"{other.returncode}):\n{out}")
    if exited:
        assert other.returncode == 0, out
    else:   # after close() returned: the interpreter's own teardown (gRPC's threads), not our API; reported
        warnings.warn(f"the other client process had not exited {CLOSE_LIMIT_S + 30} s after close() returned")
    result = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert result, out
    got = json.loads(result[-1][len("RESULT "):])
    assert got == [hf_greedy(llama.model, ids, n_theirs) for ids in theirs]
    assert short == got[0]
    ran_out = ours_then[0] == GenerateRequestStatus.GenerateFinished and ours_then[1] == 4 * LONG_RUN_TOKENS
    if not overlapped and ran_out:
        raise PremiseSpoiled(f"our long request had generated all {ours_then[1]} tokens before the other client's "
                             f"results came: no concurrency was tested (this process stalled)")
    assert overlapped, ("our long request ended before the other client's results came; ours: status "
                        f"{ours_then[0].name}, {ours_then[1]} tokens, error {ours_then[2]!r}; the other printed:\n"
                        f"{out}")
    assert final == GenerateRequestStatus.GenerateFinished
    print(f"our long request had {ours_then[1]} tokens when the other client's results came")
    # the overlap is at the start (the other's 24 tokens run beside our first ones); past the tiny model's 2048
    # positions a greedy run that long meets near-ties where our summation order and transformers' part ways
    # (one CI run: at token 25,489 of 32,000), which says nothing about concurrency
    checked = tokens[:LONG_RUN_TOKENS]
    assert_same_tokens(checked, hf_greedy(llama.model, mine, len(checked)))

    # a client process that dies mid-stream has its request released; the pool serves on
    dying = subprocess.Popen([sys.executable, "-c", DYING_CLIENT_SCRIPT, pool.address, str(LONG_RUN_TOKENS)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        line = dying.stdout.readline()
        assert line.startswith("STREAMING"), line + dying.stdout.read() if dying.poll() is not None else line
        running = client.get_as_engine_stat(MODEL).running_request
        dying.kill()
    finally:
        if dying.poll() is None:
            dying.kill()
        dying.wait()

    def idle() -> bool:
        stat = client.get_as_engine_stat(MODEL)
        return stat.running_request == 0 and stat.pendding_request == 0
    assert wait_until(idle, 10.0, 0.05), client.get_as_engine_stat(MODEL)
    assert client_greedy(client, mine, 8) == tokens[:8]
    if running != 1:    # its LONG_RUN_TOKENS had all come before this process looked: nothing was released
        raise PremiseSpoiled(f"the dying client's stream had ended before it was killed (running: {running})")


# ---- 3. many streams, and the stream limit --------------------------------------------------------
def test_300_concurrent_client_streams_all_complete_exactly(pool, llama):
    """Rank 0's gRPC server holds a stream as a coroutine, not a thread: 300 streams at once (the old thread-per-
    stream server refused all above 256 as 'pool unavailable') all finish with the tokens transformers gives."""
    from concurrent.futures import ThreadPoolExecutor
    client, _ = pool
    prompts = [random_prompt(6 + i, seed=600 + i) for i in range(6)]
    want = [hf_ref(llama.model, p, 4) for p in prompts]

    def one(i):
        status, handle, queue = client.start_request("llama", {"input_ids": prompts[i % 6]}, greedy_cfg(4))
        if status != AsStatus.ALLSPARK_SUCCESS:
            return f"start: {status.name} {client.get_last_error()}"
        tokens, _, final = collect(queue, timeout_s=300)
        client.release_request("llama", handle)
        return tokens if final == GenerateRequestStatus.GenerateFinished else f"{final.name} {queue.ErrorMessage()}"

    with ThreadPoolExecutor(300) as ex:
        results = list(ex.map(one, range(300)))
    wrong = [(i, r) for i, r in enumerate(results) if r != want[i % 6]]
    assert not wrong, f"{len(wrong)} of 300 wrong, e.g. {wrong[:3]}"
    # both ranks report their memory-bandwidth use of those decode steps; the pool's is their bandwidth-weighted mean
    stat = client.get_as_engine_stat("llama")
    rank_mbu, rank_gbs = stat.rank_memory_bandwidth_utilization, stat.rank_memory_bandwidth_gbs
    assert len(rank_mbu) == len(rank_gbs) == 2 and min(rank_mbu) > 0 and min(rank_gbs) > 0
    assert stat.memory_bandwidth_gbs == pytest.approx(sum(rank_gbs))
    assert stat.memory_bandwidth_utilization == pytest.approx(sum(m * g for m, g in zip(rank_mbu, rank_gbs))
                                                              / sum(rank_gbs))


@REDO_SPOILED
def test_streams_past_the_limit_are_refused_as_overload_and_the_pool_serves_on(new_pool, loader, llama):
    pool = new_pool(extra_args=("--max-streams", "3"))
    client = pool.client()
    install(client, loader, max_length=LONG_RUN_MAX_LENGTH)
    for _ in range(PREMISE_TRIES):
        long = start_running_streams(client, [[5, 6, 7 + i] for i in range(3)])
        status, handle, queue = client.start_request(MODEL, {"input_ids": [5, 6]}, greedy_cfg(4))
        if status != AsStatus.ALLSPARK_SUCCESS:
            break
        # Taken: fair only if one of the three long streams had already ended when the pool took it (this process
        # stalled for a whole stream). That stream's last reply came before this one's first, on one connection.
        collect(queue)
        assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS
        ended_first = wait_until(lambda: any(q.GenerateStatus() == GenerateRequestStatus.GenerateFinished
                                             and q.GeneratedLength() == LONG_RUN_TOKENS for _, _, q, _ in long), 5.0)
        assert ended_first, "a 4th stream was taken while 3 (--max-streams 3) were running"
        for _, h, _, _ in long:
            stop_and_release(client, h)
    else:
        raise PremiseSpoiled(f"the long streams ended before a 4th could be started, {PREMISE_TRIES} times: this "
                             "process is stalled for whole streams")
    assert status == AsStatus.ALLSPARK_REQUEST_DENIED and handle is None
    assert "maximum of 3 concurrent streams" in client.get_last_error()
    stat = client.get_as_engine_stat(MODEL)                             # unary calls are never refused
    assert stat.running_request + stat.pendding_request <= 3    # not the refused one
    for _, h, _, _ in long:
        assert client.release_request(MODEL, h) == AsStatus.ALLSPARK_SUCCESS
    prompt = random_prompt(9, seed=4)
    started = []                        # their streams close just after the releases return

    def admitted():
        status, h, q = client.start_request(MODEL, {"input_ids": prompt}, greedy_cfg(6))
        if status == AsStatus.ALLSPARK_SUCCESS:
            started.append((h, q))
        return bool(started)
    assert wait_until(admitted, 30)
    h, q = started[0]
    assert collect(q)[0] == hf_ref(llama.model, prompt, 6)
    assert client.release_request(MODEL, h) == AsStatus.ALLSPARK_SUCCESS
