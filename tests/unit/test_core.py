"""Unit tests of the torch-free core: span manager, request stop rules, scheduler planning."""
from __future__ import annotations

import pytest

from allspark_server.core.request import FinishReason, Request, RequestState
from allspark_server.core.scheduler import Scheduler, SchedulerConfig
from allspark_server.core.span_manager import SpanManager


def test_span_manager_allocate_free_refcount():
    sm = SpanManager(num_spans=4, span_size=16)
    assert sm.spans_for_tokens(1) == 1 and sm.spans_for_tokens(16) == 1 and sm.spans_for_tokens(17) == 2
    a = sm.allocate(3)
    assert len(set(a)) == 3 and sm.num_free_spans == 1 and not sm.can_allocate(2)
    sm.share(a[:1])
    sm.free(a)
    assert sm.num_free_spans == 3 and sm.ref_count(a[0]) == 1
    sm.free(a[:1])
    assert sm.num_free_spans == 4
    with pytest.raises(RuntimeError):
        sm.free(a[:1])
    with pytest.raises(RuntimeError):
        sm.allocate(5)


def test_request_stop_rules():
    r = Request(1, [5, 6, 7], max_length=8, eos_token_ids=(2,), stop_words_ids=((9, 9),), min_length=5)
    assert r.append_token(2) is None            # eos before min_length (4 < 5 tokens) does not stop
    assert r.append_token(2) == FinishReason.EOS
    r = Request(2, [5], max_length=10, stop_words_ids=((9, 8),))
    assert r.append_token(9) is None and r.append_token(8) == FinishReason.STOP_WORDS
    r = Request(3, [5, 6], max_length=4)
    assert r.append_token(1) is None and r.append_token(1) == FinishReason.LENGTH


def make(rid, n_prompt, max_len=100):
    return Request(rid, list(range(n_prompt)), max_length=max_len)


def test_scheduler_chunked_prefill_and_decode_first():
    s = Scheduler(SchedulerConfig(max_batch=4, max_num_batched_tokens=10), SpanManager(32, 4))
    a, b = make(1, 3), make(2, 25)
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    assert [(c.request_id, c.num_tokens, c.needs_sample) for c in plan.chunks] == [(1, 3, True), (2, 7, False)]
    assert plan.new_requests[0].token_ids == (0, 1, 2) and len(plan.new_requests[1].span_ids) == 2
    reqs = {1: a, 2: b}
    s.update(plan, {1: [42]}, reqs)
    assert a.output_ids == [42] and b.num_computed_tokens == 7
    plan, _ = s.schedule()
    # the decode of request 1 comes first, then the next prefill chunk of request 2
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [(1, 1), (2, 9)]
    assert plan.cached_requests[0].request_id == 1 and plan.cached_requests[0].new_token_ids == (42,)


def test_scheduler_max_batch_and_finish_frees_spans():
    sm = SpanManager(8, 4)
    s = Scheduler(SchedulerConfig(max_batch=1, max_num_batched_tokens=64), sm)
    a, b = make(1, 4), make(2, 4)
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    assert [c.request_id for c in plan.chunks] == [1] and len(s.waiting) == 1
    s.finish(a, FinishReason.STOPPED)
    assert sm.num_free_spans == 8 and a.state == RequestState.FINISHED
    plan, _ = s.schedule()
    assert plan.dropped_ids == (1,) and [c.request_id for c in plan.chunks] == [2]


def test_scheduler_preempts_latest_arrival_and_recomputes():
    sm = SpanManager(4, 4)                      # 16 tokens in all
    s = Scheduler(SchedulerConfig(max_batch=4, max_num_batched_tokens=64), sm)
    a, b = make(1, 7), make(2, 7)               # 2 spans each: the cache is full after prefill
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    s.update(plan, {1: [1], 2: [2]}, {1: a, 2: b})
    s.update(s.schedule()[0], {1: [1], 2: [2]}, {1: a, 2: b})   # 9 tokens each now, 8 cached
    plan, _ = s.schedule()                      # a needs a 3rd span: b (later arrival) is preempted
    assert [c.request_id for c in plan.chunks] == [1] and plan.dropped_ids == (2,)
    assert b.state == RequestState.WAITING and b.num_computed_tokens == 0 and b.output_ids == [2, 2]
    assert s.stats.num_preemptions == 1


def test_scheduler_interrupts_what_can_never_fit():
    s = Scheduler(SchedulerConfig(max_batch=2, max_num_batched_tokens=64), SpanManager(2, 4))
    big = make(1, 12)                           # 3 spans > 2 in the whole cache
    s.add(big)
    plan, interrupted = s.schedule()
    assert plan.is_empty and interrupted == [big] and big.finish_reason == FinishReason.INTERRUPTED
    assert not s.has_work()
