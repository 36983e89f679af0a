"""Shared by tests/models/test_errors_*.py (the `srv` fixture is in conftest.py): the models the error tests
serve, the probe request, the checks that a refusal names its cause and the engine still serves, and a runtime
config builder for the models those tests install."""
from __future__ import annotations

from helpers import greedy, hf_ref, random_prompt

from allspark_client import AsStatus
from allspark_server import Engine, TargetDevice

MAIN = "errs_main"          # the model every test checks the engine still serves
OTHER = "errs_other"        # a second model on the same engine (for cross-model handles)
ENGINE_MAX_LENGTH = 1024
GOOD = {"top_k": 1, "max_new_tokens": 8, "eos_token_id": []}
PROBE_PROMPT = random_prompt(7, seed=4242)
HANG_S = 120.0               # generous: only to turn a hang into a failure

OK = AsStatus.ALLSPARK_SUCCESS
PARAM = AsStatus.ALLSPARK_PARAM_ERROR
ILLEGAL = AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID
EXCEED = AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR


def assert_still_serves(engine: Engine, name: str, hf_model, restart: bool = True) -> None:
    """A normal greedy request still matches HF; nothing leaked (spans, queued/running requests and,
    with `restart`, unreleased handles: stop_model refuses while any is unreleased); restart works."""
    assert greedy(engine, name, PROBE_PROMPT, 8) == hf_ref(hf_model, PROBE_PROMPT, 8)
    stat = engine.get_as_engine_stat(name)
    assert (stat.used_span, stat.running_request, stat.pendding_request) == (0, 0, 0), stat
    if not restart:
        return
    assert engine.stop_model(name) == OK, engine.get_last_error()
    assert engine.start_model(name) == OK, engine.get_last_error()


def start_fail(engine: Engine, name: str, inputs, gen, status: AsStatus, *mentions: str) -> str:
    st, handle, queue = engine.start_request(name, inputs, gen)
    assert st == status, (st, engine.get_last_error())
    assert handle is None and queue is None
    msg = engine.get_last_error()
    for m in mentions:
        assert m in msg, (m, msg)
    return msg


def wait_terminal(queue) -> None:
    assert queue._wait_terminal(HANG_S), "request did not finish (hang?)"


def runtime_builder(srv, name: str, max_length: int = 64, **kw):
    """A runtime config builder for `name` on srv's loader: CPU, max_batch 2, spans of 16 tokens; each keyword
    calls the builder's method of that name with its value."""
    b = srv.loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=2)
    b.max_length(max_length).kv_cache_span_size(16)
    for k, v in kw.items():
        getattr(b, k)(v)
    return b
