"""Prefix cache: the hash chain against a hand-computed one, the scheduler's span bookkeeping under random traffic
(reference counts exact, a request's context always holds its own tokens, no shared span ever written), LRU
eviction and TTL; then through Engine and a 2-rank pool: greedy output identical with and without the cache,
alone, concurrent, under preemption and eviction, and `prefix_cache_len` exact."""
from __future__ import annotations

import hashlib
import random
import threading
from array import array

import pytest
from helpers import collect, greedy, random_prompt, serialize, start_engine

from allspark_server.core.prefix_cache import HostTier, PrefixCache, chain_keys
from allspark_server.core.request import FinishReason, Request, RequestState
from allspark_server.core.scheduler import Scheduler, SchedulerConfig
from allspark_server.core.span_manager import SpanManager
from allspark_server.step.kv_cache import bytes_per_span

S = 4   # span size of the unit tests


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_chain_keys_equal_a_hand_computed_blake2b_chain():
    tokens = list(range(100, 111))                       # 11 tokens: 2 full spans of 4 and a partial one
    root = hashlib.blake2b(b"model-A", digest_size=16).digest()
    k0 = hashlib.blake2b(root + array("q", [100, 101, 102, 103]).tobytes(), digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + array("q", [104, 105, 106, 107]).tobytes(), digest_size=16).digest()
    assert chain_keys(b"model-A", tokens, S, 2) == [k0, k1]
    assert chain_keys(b"model-B", tokens, S, 2)[0] != k0                  # another model: nothing shared
    other = tokens[:5] + [999] + tokens[6:]                             # differs inside span 1
    assert chain_keys(b"model-A", other, S, 2) == [k0, chain_keys(b"model-A", other, S, 2)[1]]
    assert chain_keys(b"model-A", other, S, 2)[1] != k1
    known = [k0]                                                        # extends what it was given
    assert chain_keys(b"model-A", tokens, S, 2, known) is known and known == [k0, k1]


def _scheduler(num_spans: int, max_batch: int = 4, budget: int = 12, ttl: float = 60.0, tier_slots: int = 0):
    clock = Clock()
    tier = HostTier(tier_slots) if tier_slots else None
    spans = SpanManager(num_spans, S, PrefixCache("unit", S, ttl, clock=clock, tier=tier))
    return Scheduler(SchedulerConfig(max_batch, budget), spans), spans, clock


def _run_step(sched: Scheduler, live: dict, content: dict, rng: random.Random, speculate: bool = False):
    """Plan a step, 'compute' it into `content` (span -> {slot: token}) as a runner would, sample random tokens.
    Checks on the way that every request's context already holds exactly its own tokens and that nobody writes
    a span someone else holds. `speculate`: decoding requests get random proposals (speculative decoding), of
    which a random number is accepted: rejected positions hold wrong tokens until they are computed again."""
    drafts = {req.request_id: [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
              for req in sched.running if req.num_tokens - req.num_computed_tokens == 1} if speculate else None
    plan, interrupted = sched.schedule(drafts)
    for req in interrupted:
        live.pop(req.request_id)
    tier = content.setdefault("tier", {})
    for span, slot in plan.tier_saves:          # as the runners do: saves, then loads, then the forward pass
        tier[slot] = dict(content[span])
    for slot, span in plan.tier_loads:
        content[span] = dict(tier[slot])
    for chunk in plan.chunks:
        req = live[chunk.request_id]
        toks = req.all_token_ids
        start = req.num_computed_tokens
        for p in range(start):    # the context: cached or computed earlier, it must be this request's prefix
            assert content[req.span_ids[p // S]].get(p % S) == toks[p], (req.request_id, p)
        toks = toks + list(chunk.draft_ids)
        for p in range(start, start + chunk.num_tokens):
            span = req.span_ids[p // S]
            assert sched.spans.ref_count(span) == 1, f"span {span} written while shared"
            content.setdefault(span, {})[p % S] = toks[p]
    sampled = {c.request_id: (list(c.draft_ids[:rng.randrange(len(c.draft_ids) + 1)]) if c.draft_ids else [])
               + [rng.randrange(50)] for c in plan.chunks if c.needs_sample}
    for req, _, reason in sched.update(plan, sampled, {c.request_id: live[c.request_id] for c in plan.chunks}):
        if reason is not None:
            live.pop(req.request_id)
    return plan


def _check_books(sched: Scheduler, live: dict):
    spans, cache = sched.spans, sched.spans.cache
    holders = {}
    for req in live.values():
        if req.state == RequestState.WAITING:
            assert req.span_ids == []
        for s in req.span_ids:
            holders[s] = holders.get(s, 0) + 1
    for s in range(spans.num_spans):
        assert spans.ref_count(s) == holders.get(s, 0), f"span {s}: ref {spans.ref_count(s)}, held by {holders.get(s)}"
    free = set(spans._free)
    idle = set(cache._idle)
    assert len(free) == len(spans._free) and not free & idle and not free & set(holders) and not idle & set(holders)
    assert free | idle | set(holders) == set(range(spans.num_spans))
    assert all(cache.holds(s) for s in idle)
    assert {s: k for k, s in cache._span_of.items()} == cache._key_of


@pytest.mark.parametrize("speculate", [False, True], ids=["", "speculative"])
@pytest.mark.parametrize("tier_slots", [0, 5], ids=["no_tier", "host_tier"])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_reference_counts_exact_and_contexts_true(seed, tier_slots, speculate):
    rng = random.Random(seed)
    sched, spans, clock = _scheduler(num_spans=14, max_batch=4, budget=rng.choice([6, 12, 40]), ttl=30.0,
                                     tier_slots=tier_slots)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live, content, next_id, hits = {}, {}, 0, 0
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 8:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            # longer outputs with speculation: they end sooner, and the traffic must still preempt
            req = Request(next_id, prompt, max_length=len(prompt) + rng.randrange(1, 30 if speculate else 12))
            live[next_id] = req
            sched.add(req)
            next_id += 1
        if live and rng.random() < 0.05:                                   # the user stops one
            req = rng.choice(list(live.values()))
            sched.finish(req, FinishReason.STOPPED)
            live.pop(req.request_id)
        if rng.random() < 0.03:
            clock.t += 40.0                                                # past the TTL
        _run_step(sched, live, content, rng, speculate)
        _check_books(sched, live)
        hits = sched.stats.prefix_cache_hit_tokens
    assert hits > 0 and sched.stats.num_preemptions > 0, "the traffic was meant to hit and to preempt"
    if tier_slots:
        assert content["tier"], "the traffic was meant to evict into the tier"
    for req in list(live.values()):
        sched.finish(req, FinishReason.STOPPED)
    assert spans.num_used_spans == 0 and all(spans.ref_count(s) == 0 for s in range(spans.num_spans))
    assert sched._computing == {}


def test_hit_takes_full_spans_and_leaves_the_last_token_to_compute():
    sched, spans, _ = _scheduler(num_spans=16)
    live, content, rng = {}, {}, random.Random(0)
    a = Request(0, list(range(10, 22)), max_length=13)                  # 12 tokens = 3 full spans
    live[0] = a
    sched.add(a)
    while live:
        _run_step(sched, live, content, rng)
    assert a.prefix_cache_len == 0 and spans.num_cached_idle == 3      # its 3 full spans stay cached
    b = Request(1, list(range(10, 22)), max_length=14)                  # the same prompt
    c = Request(2, list(range(10, 19)) + [99, 98], max_length=15)       # shares 2 spans and a partial third
    for r in (b, c):
        live[r.request_id] = r
        sched.add(r)
    plan = _run_step(sched, live, content, rng)
    assert b.prefix_cache_len == 8, "a whole cached prompt still computes its last span's tokens"
    assert c.prefix_cache_len == 8
    assert {ch.request_id: ch.num_tokens for ch in plan.chunks} == {1: 4, 2: 3}
    assert sched.stats.prefix_cache_hit_tokens == 16 and sched.stats.prefix_cache_miss_tokens == 12 + 4 + 3
    assert spans.ref_count(b.span_ids[0]) == 2 and b.span_ids[:2] == c.span_ids[:2]


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    sched, spans, _ = _scheduler(num_spans=16, max_batch=4, budget=8)
    live, content, rng = {}, {}, random.Random(2)
    shared = list(range(30, 42))                                         # 3 full spans
    a, b = Request(0, shared + [1], max_length=20), Request(1, shared + [2], max_length=20)
    for r in (a, b):
        live[r.request_id] = r
        sched.add(r)
    plan = _run_step(sched, live, content, rng)                          # a takes the whole budget (8 of 13)
    assert [c.request_id for c in plan.chunks] == [0]
    plan = _run_step(sched, live, content, rng)                          # a's third span is still being computed
    assert [c.request_id for c in plan.chunks] == [0] and b.state == RequestState.WAITING
    plan = _run_step(sched, live, content, rng)                          # now cached: b computes its last token only
    assert {c.request_id: c.num_tokens for c in plan.chunks} == {0: 1, 1: 1}
    assert b.prefix_cache_len == 12 and sched.stats.prefix_cache_miss_tokens == 13 + 1


def test_idle_spans_are_evicted_lru_only_when_needed_and_dropped_after_the_ttl():
    sched, spans, clock = _scheduler(num_spans=6, budget=40, ttl=100.0)
    live, content, rng = {}, {}, random.Random(1)
    for rid, base in enumerate((100, 200)):                             # two prompts, two full spans each
        req = Request(rid, list(range(base, base + 9)), max_length=10)
        live[rid] = req
        sched.add(req)
        while live:
            _run_step(sched, live, content, rng)
        clock.t += 10
    assert spans.num_cached_idle == 4 and spans.num_free_spans == 6
    big = Request(9, list(range(300, 313)), max_length=14)              # needs 4 spans: 2 free + 2 evicted
    live[9] = big
    sched.add(big)
    _run_step(sched, live, content, rng)
    old = sched.cache.lookup(sched.cache.keys(list(range(100, 109)), 2))
    new = sched.cache.lookup(sched.cache.keys(list(range(200, 209)), 2))
    assert old == [] and len(new) == 2, "the least recently used prefix goes first"
    sched.finish(big, FinishReason.STOPPED)
    live.clear()
    clock.t += 101                                                      # idle past the TTL
    sched.schedule()
    assert spans.num_cached_idle == 0 and sched.cache.num_cached == 0 and spans.num_free_spans == 6


def test_evicted_prefixes_go_to_the_host_tier_and_come_back():
    sched, spans, _ = _scheduler(num_spans=4, budget=40, tier_slots=4)
    live, content, rng = {}, {}, random.Random(3)
    first = Request(0, list(range(100, 109)), max_length=10)             # 2 full spans cached when it ends
    live[0] = first
    sched.add(first)
    while live:
        _run_step(sched, live, content, rng)
    other = Request(1, list(range(200, 213)), max_length=14)            # needs all 4 spans: both cached evicted
    live[1] = other
    sched.add(other)
    plan = _run_step(sched, live, content, rng)
    assert len(plan.tier_saves) == 2 and sched.cache.lookup(sched.cache.keys(list(range(100, 109)), 2)) == []
    sched.finish(other, FinishReason.STOPPED)
    live.clear()
    again = Request(2, list(range(100, 109)) + [7], max_length=12)       # its prefix comes back from the tier
    live[2] = again
    sched.add(again)
    plan = _run_step(sched, live, content, rng)                          # (checks the copied content is true)
    assert len(plan.tier_loads) == 2 and again.prefix_cache_len == 8
    assert [c.num_tokens for c in plan.chunks] == [2]
    assert len(sched.cache.tier) == 4         # and the two of the stopped request evicted to make room for it


# ---- through the engines ------------------------------------------------------------------------------------

SYSTEM = random_prompt(150, seed=7)                                     # a shared "system prompt"


@pytest.fixture(scope="module")
def loader(llama, tmp_path_factory):
    return serialize(llama.hf_dir, "pc", str(tmp_path_factory.mktemp("prefix_cache")))


@pytest.fixture(scope="module")
def uncached(loader):
    return start_engine(loader, "plain", max_batch=8, max_length=512, prefix_cache=False)


def _turns(n: int):
    return [SYSTEM + random_prompt(5 + 9 * i, seed=200 + i) for i in range(n)]


def test_engine_hits_are_exact_and_change_no_token(loader, uncached):
    engine = start_engine(loader, "cached", max_batch=8, max_length=512, span_size=16)
    prompts = _turns(4) + [SYSTEM[:100]]
    want = [greedy(uncached, "plain", p, 12) for p in prompts]
    gen = {"top_k": 1, "max_new_tokens": 12, "eos_token_id": []}
    got, cache_lens = [], []
    for p in prompts:
        _, handle, queue = engine.start_request("cached", {"input_ids": p}, gen)
        tokens, elements, _ = collect(queue)
        got.append(tokens)
        cache_lens.append(elements[0].prefix_cache_len)
        assert queue.RequestStatInfo()["context_cached_length"] == elements[0].prefix_cache_len
        engine.release_request("cached", handle)
    assert got == want
    # the first prompt fills 9 spans of 16 of the 150-token prefix; later ones share them (and no more: their own
    # tokens follow); the 100-token prefix of the system prompt takes its 6 full spans
    assert cache_lens == [0, 144, 144, 144, 96]
    stat = engine.get_as_engine_stat("cached")
    hit = sum(cache_lens)
    miss = sum(len(p) for p in prompts) - hit
    assert (stat.prefix_cache_hit_token, stat.prefix_cache_miss_token) == (hit, miss)
    assert stat.prefix_cache_hit_rate == pytest.approx(hit / (hit + miss))
    assert stat.prefix_cache_miss_rate == pytest.approx(miss / (hit + miss))
    assert stat.used_span == 0 and stat.prefix_cache_spans > 0
    # a second turn's prompt contains the first turn's output: its spans were cached while it decoded
    first = prompts[0] + got[0] + random_prompt(40, seed=9)
    assert greedy(engine, "cached", first, 8) == greedy(uncached, "plain", first, 8)
    engine.release_model("cached")


def test_engine_concurrent_and_preempted_requests_match_the_uncached_engine(loader, uncached, llama):
    prompts = _turns(10)
    want = [greedy(uncached, "plain", p, 30) for p in prompts]
    args = loader.args
    # 40 spans of 16: one request needs at most 13; eight at once force preemption and evict cached spans
    budget = 40 * bytes_per_span(args.num_layers, 16, args.num_kv_heads, args.head_dim, loader.data_type)
    engine = start_engine(loader, "tight", max_batch=8, max_length=512, kv_bytes=budget, prefill=64)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = greedy(engine, "tight", prompts[i], 30)
        except Exception as e:   # reported below
            errors.append(repr(e))
    for rnd in range(2):                              # the second round starts with a warm cache
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and [results[i] for i in range(len(prompts))] == want, (rnd, errors)
    stat = engine.get_as_engine_stat("tight")
    assert stat.num_preempted > 0 and stat.prefix_cache_hit_token > 0
    assert stat.used_span == 0
    engine.release_model("tight")


def test_engine_with_a_host_tier_keeps_every_token(loader, uncached):
    prompts = _turns(6)
    want = [greedy(uncached, "plain", p, 20) for p in prompts]
    args = loader.args
    per_span = bytes_per_span(args.num_layers, 16, args.num_kv_heads, args.head_dim, loader.data_type)
    engine = start_engine(loader, "tiered", max_batch=1, max_length=512, kv_bytes=14 * per_span,
                          host_tier_bytes=64 * per_span)
    for rnd in range(2):        # 14 spans hold one request: every round evicts the others' prefixes to the tier
        assert [greedy(engine, "tiered", p, 20) for p in prompts] == want, rnd
    stat = engine.get_as_engine_stat("tiered")
    assert stat.prefix_cache_host_spans > 0 and stat.prefix_cache_hit_token >= 6 * 144
    engine.release_model("tiered")


def test_pool_serves_cache_hits_with_the_same_tokens(pool, loader, uncached):
    client, _ = pool
    prompts = _turns(3)
    want = [greedy(uncached, "plain", p, 10) for p in prompts]
    gen = {"top_k": 1, "max_new_tokens": 10, "eos_token_id": []}
    before = client.get_as_engine_stat("llama").prefix_cache_hit_token
    got, lens = [], []
    for p in prompts:
        _, handle, queue = client.start_request("llama", {"input_ids": p}, gen)
        tokens, elements, _ = collect(queue)
        got.append(tokens)
        lens.append(elements[-1].prefix_cache_len)
        client.release_request("llama", handle)
    assert got == want
    assert lens[1:] == [144, 144]                          # span size 16 in the shared pool
    assert client.get_as_engine_stat("llama").prefix_cache_hit_token - before >= 288
