"""Soak: many requests of random lengths and parameters, a share of them stopped or released mid-stream, through a
real 2-rank pool by 16 client threads at once. None may be lost: every request ends Finished (with exactly its
tokens), or, when stopped or released, Finished or Interrupted; none ends InternalError. Afterwards nothing may
have leaked: no running or pending request, no KV span held by a request (the prefix cache's idle spans count as
free: any allocation may take them), the ranks' file descriptors back to what they were after warm-up, their
threads too (but for rank 0's bounded call pool), and their RSS within a bound of it; the client's stream
threads and descriptors too.

CI runs ALLSPARK_SOAK_REQUESTS=400 (default); `ALLSPARK_SOAK_REQUESTS=10000 pytest -s tests/pool/test_soak.py` is the
full soak, whose RSS bound is the issue's 5% (the short run allows 10%: its warm-up is too short for the
allocator to settle)."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
from helpers import collect, random_prompt
from pool_helpers import MODEL, install, read_at_least, wait_until

from allspark_client import GenerateRequestStatus
from allspark_client.settings import SOAK_REQUESTS
from allspark_client.types import AsStatus

REQUESTS = SOAK_REQUESTS.get()
IN_FLIGHT = 16
WARM_UP = max(50, REQUESTS // 10)
RSS_BOUND = 0.05 if REQUESTS >= 5000 else 0.10
ACTIONS = ("finish", "finish", "finish", "finish", "stop", "release")


def random_config(r: random.Random, new_tokens: int) -> dict:
    cfg = {"max_new_tokens": new_tokens, "eos_token_id": []}
    if r.random() < 0.3:
        cfg["top_k"] = 1
    else:
        cfg.update(top_k=r.choice([0, 5, 40]), top_p=r.choice([1.0, 0.9, 0.5]), temperature=r.choice([0.7, 1.0, 1.3]),
                   seed=r.randrange(1 << 31))
    if r.random() < 0.3:
        cfg["repetition_penalty"] = r.choice([1.05, 1.2])
    if r.random() < 0.2:
        cfg["presence_penalty"] = r.choice([0.5, 1.0])
    if r.random() < 0.2:
        cfg.update(logprobs=True, top_logprobs=r.randint(0, 4))
    return cfg


def one_request(client, i: int) -> str:
    """Run request i to its end; what became of it ('finish', 'stop', 'release'), or an AssertionError."""
    r = random.Random(i)
    new_tokens = r.randint(1, 48)
    action = r.choice(ACTIONS) if new_tokens > 4 else "finish"
    status, handle, queue = client.start_request(MODEL, {"input_ids": random_prompt(r.randint(1, 80), seed=i)},
                                                 random_config(r, new_tokens))
    assert status == AsStatus.ALLSPARK_SUCCESS, (i, client.get_last_error())
    if action == "finish":
        tokens, _, final = collect(queue, timeout_s=120)
        assert final == GenerateRequestStatus.GenerateFinished and len(tokens) == new_tokens, \
            (i, final, len(tokens), new_tokens, queue.ErrorMessage())
    else:
        first = read_at_least(queue, r.randint(1, new_tokens // 2))
        if action == "stop":
            assert client.stop_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, (i, client.get_last_error())
        else:                                                    # released mid-stream: the client walks away
            assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, (i, client.get_last_error())
            return action
        rest, _, final = collect(queue, timeout_s=120)
        assert final in (GenerateRequestStatus.GenerateFinished, GenerateRequestStatus.GenerateInterrupted), \
            (i, final, queue.ErrorMessage())
        assert len(first) + len(rest) <= new_tokens
    assert client.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, (i, client.get_last_error())
    return action


def usage(processes: list[psutil.Process]) -> list[dict]:
    return [{"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()} for p in processes]


def test_soak_nothing_lost_nothing_leaked(new_pool, loader):
    pool = new_pool()
    client = pool.client()
    install(client, loader, max_length=256, max_batch=IN_FLIGHT)
    idle_stat = client.get_as_engine_stat(MODEL)
    ranks = pool.ranks()
    me = psutil.Process()
    outcomes: Counter = Counter()
    marks: dict = {}
    lock = threading.Lock()
    started = time.monotonic()

    def run(i: int) -> None:
        action = one_request(client, i)
        with lock:
            outcomes[action] += 1
            if sum(outcomes.values()) == WARM_UP:               # the baseline: after warm-up, mid-traffic
                marks["warm"] = usage(ranks)
                marks["client_fds"] = me.num_fds()

    with ThreadPoolExecutor(IN_FLIGHT) as workers:
        for f in [workers.submit(run, i) for i in range(REQUESTS)]:
            f.result()
    took = time.monotonic() - started
    assert sum(outcomes.values()) == REQUESTS

    # back to idle: no request, no span but the prefix cache's, threads and descriptors back
    def settled() -> bool:
        stat = client.get_as_engine_stat(MODEL)
        return (stat.running_request == 0 and stat.pendding_request == 0
                and stat.used_span == 0 and stat.free_span == stat.total_span == idle_stat.total_span)
    stat = client.get_as_engine_stat(MODEL)
    assert wait_until(settled, 30.0, 0.2), {k: getattr(stat, k) for k in (
        "running_request", "pendding_request", "total_span", "used_span", "free_span", "prefix_cache_spans",
        "prefix_cache_host_spans")}
    # rank 0's call pool (service.ENGINE_CALL_THREADS) adds a thread the first time that many blocking calls
    # run at once, and keeps it: at most one per client thread here; anything beyond is a leak
    assert wait_until(lambda: all(u["threads"] <= w["threads"] + IN_FLIGHT and u["fds"] <= w["fds"]
                                  for u, w in zip(usage(ranks), marks["warm"])), 30.0, 0.2), \
        (usage(ranks), marks["warm"])
    client_threads = len([t for t in threading.enumerate() if t.name.startswith("allspark-stream-")])
    assert client_threads == 0, client_threads
    assert me.num_fds() <= marks["client_fds"], (me.num_fds(), marks["client_fds"])
    end = usage(ranks)
    growth = [e["rss"] / w["rss"] - 1 for e, w in zip(end, marks["warm"])]
    print(f"soak: {REQUESTS} requests in {took:.0f}s ({dict(outcomes)}); RSS growth after warm-up per rank "
          f"{[f'{g * 100:+.1f}%' for g in growth]} (rss MiB {[round(e['rss'] / 2**20) for e in end]}); "
          f"fds {[e['fds'] for e in end]} vs {[w['fds'] for w in marks['warm']]}; threads "
          f"{[e['threads'] for e in end]}; client fds {me.num_fds()}, threads {me.num_threads()}")
    assert all(g < RSS_BOUND for g in growth), growth
    assert pool.proc.poll() is None
