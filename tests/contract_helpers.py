"""Shared by tests/pool/test_contract_*.py (the `api` fixture is in conftest.py): constants and helpers for one
set of test bodies run on the in-process `Engine` and on a 2-rank pool's `ClientEngine`, both serving
the GQA Llama as "llama"; every request a test starts is released by that test."""
from __future__ import annotations

import json

from helpers import LONG_RUN_MAX_LENGTH, LONG_RUN_TOKENS, collect, hf_ref, random_prompt  # noqa: F401 (re-exported)

from allspark_client import AsStatus, GenerateRequestStatus

NAME = "llama"
ENGINE_MAX_LENGTH = LONG_RUN_MAX_LENGTH      # served_llama and the pool fixture
VOCAB = 512
HANG_S = 120.0                  # generous: only turns a hang into a failure
S = GenerateRequestStatus
OK = AsStatus.ALLSPARK_SUCCESS
PARAM = AsStatus.ALLSPARK_PARAM_ERROR
ILLEGAL = AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID
EXCEED = AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR
GREEDY = {"top_k": 1, "eos_token_id": []}
PROBE = random_prompt(7, seed=7001)
SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "max_new_tokens": 24, "eos_token_id": []}
PROMPTS = [random_prompt(n, seed=7100 + n) for n in (5, 17, 40)]


def is_pool(engine) -> bool:
    return engine.is_allspark_work_as_service()


def run(engine, ids, gen, name: str = NAME):
    """Start, read to the end, release: (tokens, elements, queue). Asserts GenerateFinished."""
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen)
    assert status == OK, (status, engine.get_last_error())
    try:
        tokens, elements, final = collect(queue, HANG_S)
    finally:
        assert engine.release_request(name, handle) == OK, engine.get_last_error()
    assert final == S.GenerateFinished, (final, queue.ErrorMessage())
    return tokens, elements, queue


def refused(engine, inputs, gen, status: AsStatus, *mentions: str, name: str = NAME) -> str:
    st, handle, queue = engine.start_request(name, inputs, gen)
    if st == OK:        # never leak a request that should not have started
        engine.release_request(name, handle)
    assert st == status, (st, engine.get_last_error())
    assert handle is None and queue is None
    msg = engine.get_last_error()
    for m in mentions:
        assert m in msg, (m, msg)
    return msg


def assert_serves(engine, hf_model, name: str = NAME) -> None:
    ours, theirs = run(engine, PROBE, dict(GREEDY, max_new_tokens=8), name)[0], hf_ref(hf_model, PROBE, 8)
    stat = engine.get_as_engine_stat(name)   # a mismatch says what the cache held (a shared pool's history)
    assert ours == theirs, (ours, theirs, stat.prefix_cache_hit_token, stat.prefix_cache_spans, stat.used_span)


def own_model_cfg(loader, name: str):
    return (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4)
            .max_length(512).kv_cache_span_size(16).build())


_engine_refs: dict = {}


def in_process_reference(request, prompt, gen) -> list[int]:
    """The same request on the in-process Engine (served_llama), computed once per (prompt, gen)."""
    key = (tuple(prompt), json.dumps(gen, sort_keys=True))
    if key not in _engine_refs:
        engine, _ = request.getfixturevalue("served_llama")
        _engine_refs[key] = run(engine, prompt, gen)[0]
    return _engine_refs[key]
