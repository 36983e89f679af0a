"""Error paths of the in-process Engine, request-lifecycle side: request handles (unknown, another model's,
released), stopping / syncing live requests, and concurrency (threads mixing bad and good requests, stop_model
racing start_request). Models, the runtime config and the loader: test_errors_models.py. After each error the
engine must still serve (see errors_helpers.assert_still_serves)."""
from __future__ import annotations

import threading

import pytest
from errors_helpers import (
    ENGINE_MAX_LENGTH,
    EXCEED,
    GOOD,
    HANG_S,
    ILLEGAL,
    MAIN,
    OK,
    OTHER,
    PARAM,
    PROBE_PROMPT,
    assert_still_serves,
    runtime_builder,
    start_fail,
    wait_terminal,
)
from helpers import greedy, hf_ref, random_prompt

from allspark_client import AsStatus, GenerateRequestStatus, RequestHandle

# ------------------------------------------------------------------------------------------------
# request handles
# ------------------------------------------------------------------------------------------------

def _all_handle_calls(engine, name, handle):
    return {"stop": engine.stop_request(name, handle), "release": engine.release_request(name, handle),
            "sync": engine.sync_request(name, handle)}


def test_unknown_handle(srv):
    e = srv.engine
    for handle in (RequestHandle(MAIN, 999999), None, 999999, "abc"):
        for call in (e.stop_request, e.release_request, e.sync_request):
            if handle is None and call == e.sync_request:
                continue        # sync_request(name, None) means "all requests"
            assert call(MAIN, handle) == ILLEGAL, (call.__name__, handle)
            assert repr(handle) in e.get_last_error() and MAIN in e.get_last_error()
    assert_still_serves(e, MAIN, srv.hf)


def test_handle_of_another_model(srv):
    e = srv.engine
    st_a, h_a, q_a = e.start_request(MAIN, {"input_ids": PROBE_PROMPT}, GOOD)
    st_b, h_b, q_b = e.start_request(OTHER, {"input_ids": PROBE_PROMPT}, GOOD)
    assert st_a == OK and st_b == OK
    try:
        wait_terminal(q_a)
        wait_terminal(q_b)
        for name, handle in ((MAIN, h_b), (OTHER, h_a),
                             (MAIN, RequestHandle(OTHER, h_a.request_id)),   # right id, wrong model name
                             (OTHER, RequestHandle(MAIN, h_b.request_id))):
            assert _all_handle_calls(e, name, handle) == {"stop": ILLEGAL, "release": ILLEGAL, "sync": ILLEGAL}
            assert "unknown or released request handle" in e.get_last_error()
        # the wrong-model calls did not touch the real requests
        for q in (q_a, q_b):
            assert q.GenerateStatus() == GenerateRequestStatus.GenerateFinished
            assert q.GeneratedLength() == 8
            assert q.GetNoWait().ids_from_generate == hf_ref(srv.hf, PROBE_PROMPT, 8)
    finally:
        assert e.release_request(MAIN, h_a) == OK
        assert e.release_request(OTHER, h_b) == OK
    assert_still_serves(e, MAIN, srv.hf)
    assert_still_serves(e, OTHER, srv.hf)


def test_released_handle_and_its_queue(srv):
    e = srv.engine
    prompt = random_prompt(12, seed=21)
    status, handle, queue = e.start_request(MAIN, {"input_ids": prompt}, GOOD)
    assert status == OK
    assert e.sync_request(MAIN, handle) == OK
    assert e.release_request(MAIN, handle) == OK
    # double release, and every other call with the released handle
    assert _all_handle_calls(e, MAIN, handle) == {"stop": ILLEGAL, "release": ILLEGAL, "sync": ILLEGAL}
    assert repr(handle) in e.get_last_error()
    # the queue still hands out everything it had
    assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
    assert queue.GeneratedLength() == 8
    el = queue.Get()
    assert el.ids_from_generate == hf_ref(srv.hf, prompt, 8)
    assert queue.Get() is None and queue.GetNoWait() is None
    assert_still_serves(e, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# stopping and syncing live requests
# ------------------------------------------------------------------------------------------------

LONG = {"top_k": 1, "max_new_tokens": 500, "eos_token_id": []}


@pytest.mark.parametrize("how", ["stop_request", "release_request"])
def test_stop_mid_stream(srv, how):
    e = srv.engine
    prompt = random_prompt(8, seed=31)
    status, handle, queue = e.start_request(MAIN, {"input_ids": prompt}, LONG)
    assert status == OK
    try:
        first = queue.GetWithTimeout(int(HANG_S * 1000))
        assert first is not None and len(first.ids_from_generate) >= 1
        assert getattr(e, how)(MAIN, handle) == OK
        # stop/release return once the engine has taken the request out: the status is final now
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
        tokens = list(first.ids_from_generate)
        while (el := queue.GetNoWait()) is not None:
            tokens.extend(el.ids_from_generate)
        n = queue.GeneratedLength()
        assert len(tokens) == n and n <= 500
        assert queue.Get() is None                       # terminal and drained: no blocking
        k = min(n, 8)
        assert tokens[:k] == hf_ref(srv.hf, prompt, 8)[:k]
        assert_still_serves(e, MAIN, srv.hf, restart=False)   # others run; the stopped one stays still
        assert queue.GeneratedLength() == n and queue.GetNoWait() is None
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
    finally:
        if how == "stop_request":
            assert e.stop_request(MAIN, handle) == OK     # stopping a stopped (unreleased) request is fine
            assert e.release_request(MAIN, handle) == OK
    assert e.stop_request(MAIN, handle) == ILLEGAL
    assert_still_serves(e, MAIN, srv.hf)


def test_sync_all_requests(srv):
    e = srv.engine
    prompts = [random_prompt(5 + i, seed=40 + i) for i in range(3)]
    lengths = [16, 24, 32]
    started = [e.start_request(MAIN, {"input_ids": p}, {**GOOD, "max_new_tokens": n})
               for p, n in zip(prompts, lengths)]
    assert all(s == OK for s, _, _ in started)
    done = []
    t = threading.Thread(target=lambda: done.append(e.sync_request(MAIN, None)), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive() and done == [OK]
    for (_, handle, queue), p, n in zip(started, prompts, lengths):
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished
        assert queue.GeneratedLength() == n
        assert e.release_request(MAIN, handle) == OK
    assert e.sync_request(MAIN, None) == OK          # nothing live: returns at once
    assert_still_serves(e, MAIN, srv.hf)


# ------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------

def test_concurrent_bad_and_good_requests(srv):
    e, n_threads, rounds = srv.engine, 8, 2
    prompts = [random_prompt(4 + i, seed=60 + i) for i in range(n_threads)]
    expected = [hf_ref(srv.hf, p, 8) for p in prompts]       # HF is not thread safe: compute up front
    # this thread's last error must survive the other threads' errors (get_last_error is per thread)
    start_fail(e, MAIN, {"input_ids": PROBE_PROMPT}, {"main_thread_marker": 1}, PARAM, "main_thread_marker")
    barrier = threading.Barrier(n_threads)
    errors: list = []
    results: dict = {}

    def worker(i: int):
        try:
            barrier.wait(HANG_S)
            got = []
            for r in range(rounds):
                start_fail(e, MAIN, {"input_ids": prompts[i]}, {f"bogus_{i}_{r}": 1}, PARAM, f"bogus_{i}_{r}")
                start_fail(e, MAIN, {"input_ids": [5, srv.vocab + i]}, GOOD, PARAM, str(srv.vocab + i))
                start_fail(e, MAIN, {"input_ids": prompts[i]}, {"max_length": ENGINE_MAX_LENGTH + 1 + i}, EXCEED,
                           str(ENGINE_MAX_LENGTH + 1 + i))
                assert e.release_request(MAIN, RequestHandle(MAIN, 10**9 + i)) == ILLEGAL
                assert str(10**9 + i) in e.get_last_error()
                got.append(greedy(e, MAIN, prompts[i], 8))
            results[i] = got
        except BaseException as ex:   # reported below
            errors.append((i, repr(ex)))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert errors == []
    assert results == {i: [expected[i]] * rounds for i in range(n_threads)}
    assert "main_thread_marker" in e.get_last_error()
    assert_still_serves(e, MAIN, srv.hf)


def test_stop_model_racing_start_request(srv, monkeypatch):
    """Deterministic replay of the race: stop_model runs after start_request's is_running check."""
    import allspark_server.engine.engine as engine_mod
    e, name = srv.engine, "errs_race"
    assert e.install_model(runtime_builder(srv, name).build()) == OK and e.start_model(name) == OK
    real_parse = engine_mod.parse_request
    stopped = []

    def parse_then_stop(*args, **kw):       # runs between the is_running check and the registration
        if not stopped:
            stopped.append(e.stop_model(name))
        return real_parse(*args, **kw)

    monkeypatch.setattr(engine_mod, "parse_request", parse_then_stop)
    status, handle, queue = e.start_request(name, {"input_ids": PROBE_PROMPT}, GOOD)
    monkeypatch.setattr(engine_mod, "parse_request", real_parse)
    try:
        assert stopped == [OK]
        assert status == AsStatus.ALLSPARK_REQUEST_DENIED, "accepted a request into a model being stopped"
    finally:
        if status == OK:      # the request sits in the stopped loop's inbox until the model restarts
            assert queue.GenerateStatus() == GenerateRequestStatus.Init
            assert e.start_model(name) == OK
            wait_terminal(queue)
            assert e.release_request(name, handle) == OK
        assert e.release_model(name) == OK
        assert_still_serves(e, MAIN, srv.hf)
