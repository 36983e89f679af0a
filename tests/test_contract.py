"""The contract suite: one set of test bodies against the in-process `Engine` and `ClientEngine` on a
real 2-rank pool (tensor parallel over MPI, started by allspark-launch).

Every test compares against an independent reference (transformers: greedy generate, step-by-step
reference loops, the HF model's logits), a hand-worked expectation, or checks a specific status and
message. Both engines serve the GQA Llama as "llama"; lifecycle tests install their own extra model
under a unique name and release it. Every request a test starts is released by that test.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

import allspark_client
import allspark_client.client as client_module
import allspark_server.engine as engine_module
from allspark_client import AsException, AsStatus, GenerateRequestStatus, RequestHandle, ResultQueue
from allspark_client.config import AsModelRuntimeConfigBuilder
from helpers import collect, hf_greedy, random_prompt

NAME = "llama"
ENGINE_MAX_LENGTH = 1024
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


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["engine", "pool"], ids=["engine", "pool"])
def api(request, llama):
    """(engine_like, loader, hf_model): the in-process Engine or a ClientEngine on a 2-rank pool."""
    fixture = "served_llama" if request.param == "engine" else "pool"
    engine, loader = request.getfixturevalue(fixture)
    yield engine, loader, llama.model
    # nothing this module started is left running or holding KV spans
    assert engine.sync_request(NAME, None) == OK
    stat = engine.get_as_engine_stat(NAME)
    assert (stat.running_request, stat.pendding_request, stat.used_span) == (0, 0, 0), stat


def is_pool(engine) -> bool:
    return engine.is_allspark_work_as_service()


_hf_cache: dict = {}


def hf_ref(model, ids, n: int) -> list[int]:
    """transformers greedy continuation (cached: both parametrizations share it)."""
    key = (id(model), tuple(ids), n)
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(model, ids, n)
    return _hf_cache[key]


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double()      # [L, V]


def hf_loop(model, prompt, max_new: int, process, eos=()) -> list[int]:
    """Greedy decoding with the HF model (full recompute per step); process(all_ids, out, logits[V])."""
    ids, out = list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        tok = int(torch.argmax(process(list(ids), list(out), logits)))
        ids.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


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
    assert run(engine, PROBE, dict(GREEDY, max_new_tokens=8), name)[0] == hf_ref(hf_model, PROBE, 8)


def own_model_cfg(loader, name: str):
    return (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4)
            .max_length(512).kv_cache_span_size(16).build())


class RecordingQueue(ResultQueue):
    """Records every status the queue goes through, in order."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.history = [self.GenerateStatus()]

    def _set_status_locked(self, status, now):
        super()._set_status_locked(status, now)
        if self.history[-1] != self._status:
            self.history.append(self._status)


class DelayedTerminalQueue(ResultQueue):
    """A ResultQueue whose terminal status reaches it DELAY_S late (tokens arrive at once): a slow link
    between a pool and its client. Installed for ClientEngine only; an in-process Engine has no link."""
    DELAY_S = 1.0

    def _push(self, elements, status):
        if status.is_terminal:                       # the tokens now, the final status late
            super()._push(elements, S.Generating)
            self._set_status(status)
        else:
            super()._push(elements, status)

    def _set_status(self, status, error=None):
        if status.is_terminal and not self.GenerateStatus().is_terminal:
            time.sleep(self.DELAY_S)
        super()._set_status(status, error)


# ------------------------------------------------------------------------------------------------
# lifecycle, info, stats
# ------------------------------------------------------------------------------------------------

def test_own_model_lifecycle(api):
    engine, loader, hf = api
    name = "contract_life_" + ("pool" if is_pool(engine) else "engine")
    assert engine.install_model(own_model_cfg(loader, name)) == OK
    try:
        # installed, not started: denied
        refused(engine, {"input_ids": PROBE}, GREEDY, AsStatus.ALLSPARK_REQUEST_DENIED, name, "not started",
                name=name)
        assert json.loads(engine.get_model_info(name))["started"] is False
        assert engine.start_model(name) == OK and engine.start_model(name) == OK     # twice is harmless
        info = json.loads(engine.get_model_info(name))
        assert info["started"] is True and info["engine_max_length"] == 512 and info["engine_max_batch"] == 4
        assert_serves(engine, hf, name)
        # an unreleased (finished) request blocks stop_model and release_model
        status, handle, queue = engine.start_request(name, {"input_ids": PROBE}, dict(GREEDY, max_new_tokens=8))
        assert status == OK
        try:
            assert engine.sync_request(name, handle) == OK
            assert queue.GenerateStatus() == S.GenerateFinished
            for call in (engine.stop_model, engine.release_model):
                assert call(name) == AsStatus.ALLSPARK_RUNTIME_ERROR, call.__name__
                msg = engine.get_last_error()
                assert "release_request" in msg and "1 unreleased" in msg and name in msg, msg
            assert_serves(engine, hf, name)          # the refused stop left it serving
        finally:
            assert engine.release_request(name, handle) == OK
        assert queue.Get().ids_from_generate == hf_ref(hf, PROBE, 8)    # released: the queue stays readable
        # stopped: denied, still installed
        assert engine.stop_model(name) == OK, engine.get_last_error()
        refused(engine, {"input_ids": PROBE}, GREEDY, AsStatus.ALLSPARK_REQUEST_DENIED, name, "not started",
                name=name)
        assert json.loads(engine.get_model_info(name))["started"] is False
        assert engine.stop_model(name) == OK                                       # twice is harmless
        assert_serves(engine, hf)                                                  # the other model is untouched
        # restarted: serves again
        assert engine.start_model(name) == OK
        assert_serves(engine, hf, name)
        assert engine.stop_model(name) == OK, engine.get_last_error()
    finally:
        assert engine.release_model(name) == OK, engine.get_last_error()
    # released: unknown
    refused(engine, {"input_ids": PROBE}, GREEDY, PARAM, repr(name), "not installed", name=name)
    with pytest.raises(AsException) as ei:
        engine.get_model_info(name)
    assert ei.value.status == PARAM and repr(name) in str(ei.value)
    assert_serves(engine, hf)


def test_release_then_stop_model_right_away(api):
    """release_request returning means the request is gone: stop_model must not see it."""
    engine, loader, hf = api
    name = "contract_relstop_" + ("pool" if is_pool(engine) else "engine")
    assert engine.install_model(own_model_cfg(loader, name)) == OK
    assert engine.start_model(name) == OK
    try:
        for i in range(5):
            run(engine, PROBE, dict(GREEDY, max_new_tokens=4), name)
            assert engine.stop_model(name) == OK, (i, engine.get_last_error())
            assert engine.start_model(name) == OK
    finally:
        engine.sync_request(name, None)
        assert engine.release_model(name) == OK, engine.get_last_error()


def test_unknown_model(api):
    engine, _, hf = api
    refused(engine, {"input_ids": PROBE}, GREEDY, PARAM, "'nope'", "not installed", name="nope")
    for call in (engine.start_model, engine.stop_model, engine.release_model, engine.sync_request):
        assert call("nope") == PARAM, call.__name__
        assert "'nope'" in engine.get_last_error() and "not installed" in engine.get_last_error()
    for call in (engine.get_model_info, engine.get_as_engine_stat):
        with pytest.raises(AsException) as ei:
            call("nope")
        assert ei.value.status == PARAM and "'nope'" in str(ei.value), call.__name__
    assert_serves(engine, hf)


def test_handle_calls_on_unknown_model(api, request):
    """stop/release/sync of a handle for a model that is not installed: PARAM_ERROR naming the model."""
    engine, _, hf = api
    for call in (engine.stop_request, engine.release_request, engine.sync_request):
        assert call("nope", RequestHandle("nope", 1)) == PARAM, call.__name__
        assert "'nope'" in engine.get_last_error() and "not installed" in engine.get_last_error()


def test_install_errors(api, tmp_path):
    engine, loader, hf = api
    missing = str(tmp_path / "absent.asgraph")
    cfg = (AsModelRuntimeConfigBuilder().model_name("contract_missing")
           .model_file_path(missing, loader.weights_path).max_length(64).build())
    with pytest.raises(AsException) as ei:
        engine.install_model(cfg)
    assert ei.value.status == PARAM and missing in str(ei.value) and "does not exist" in str(ei.value)
    with pytest.raises(AsException):          # the failed name was not registered
        engine.get_model_info("contract_missing")
    # the name being served cannot be installed twice (nothing is touched)
    with pytest.raises(AsException) as ei:
        engine.install_model(own_model_cfg(loader, NAME))
    assert ei.value.status == PARAM and "already installed" in str(ei.value)
    with pytest.raises(AsException) as ei:
        engine.install_model({"model_name": "x"})
    assert "AsModelConfig" in str(ei.value)
    assert_serves(engine, hf)


def test_model_info(api):
    engine, loader, hf = api
    info = json.loads(engine.get_model_info(NAME))
    cfg = hf.config
    assert info["model_name"] == NAME and info["architecture"] == "LlamaForCausalLM"
    assert info["dtype"] == "float32" and info["started"] is True
    assert info["engine_max_length"] == ENGINE_MAX_LENGTH and info["engine_max_batch"] == 8
    assert info["span_size"] == 16 and info["kv_spans"] > 0
    assert info["world_size"] == (2 if is_pool(engine) else 1)
    args = info["args"]
    assert args["vocab_size"] == cfg.vocab_size == VOCAB
    assert args["hidden_size"] == cfg.hidden_size
    assert args["num_heads"] == cfg.num_attention_heads
    assert args["num_kv_heads"] == cfg.num_key_value_heads and args["num_layers"] == cfg.num_hidden_layers


def test_engine_stat_consistent(api):
    engine, _, hf = api
    before = engine.get_as_engine_stat(NAME)
    assert before.model_name == NAME and before.span_size == 16
    assert before.free_span + before.used_span == before.total_span > 0
    assert before.total_token == before.total_span * before.span_size
    assert before.free_token == before.free_span * before.span_size
    prompt = random_prompt(21, seed=7002)
    tokens, _, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=13))
    after = engine.get_as_engine_stat(NAME)
    assert tokens == hf_ref(hf, prompt, 13)
    assert after.total_generated_token - before.total_generated_token == 13
    assert after.total_prefill_token - before.total_prefill_token == 21
    assert (after.used_span, after.running_request, after.pendding_request) == (0, 0, 0)
    assert after.free_token == after.total_token
    assert after.pending_request == after.pendding_request and "free_token=" in after.ToString()


def test_identity(api):
    engine, _, _ = api
    assert engine.is_allspark_work_as_service() is is_pool(engine)
    assert engine.is_allspark_work_as_service() is (type(engine).__name__ == "ClientEngine")
    assert engine.get_rank_id() == 0
    version = engine.get_version_full()
    assert re.fullmatch(r"\d+\.\d+\.\d+/\(GitSha1:[^)]+\)/\(Build:[^)]+\)", version), version
    assert version.split("/")[0] == allspark_client.__version__
    from allspark_client.api import EngineProtocol
    assert isinstance(engine, EngineProtocol)            # one API, both shapes


# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------

PROMPTS = [random_prompt(n, seed=7100 + n) for n in (5, 17, 40)]


@pytest.mark.parametrize("form", ["list", "numpy", "torch_1d", "torch_2d", "ids", "text"])
def test_greedy_stream_matches_hf(api, form):
    engine, loader, hf = api
    gen = dict(GREEDY, max_new_tokens=48)
    if form == "text":
        cases = ["Hello world! The quick brown fox", "Once upon a time there was"]
        prompts = [loader.get_tokenizer().encode(t) for t in cases]
    else:
        cases = prompts = PROMPTS
    for case, prompt in zip(cases, prompts):
        if form == "text":
            status, handle, queue = engine.start_request_text(NAME, loader, case, gen)
        elif form == "ids":
            status, handle, queue = engine.start_request_ids(NAME, loader, prompt, gen)
        else:
            ids = {"list": list, "numpy": np.array, "torch_1d": torch.tensor,
                   "torch_2d": lambda p: torch.tensor([p])}[form](prompt)
            status, handle, queue = engine.start_request(NAME, {"input_ids": ids}, gen)
        assert status == OK, engine.get_last_error()
        try:
            tokens, _, final = collect(queue, HANG_S)
        finally:
            assert engine.release_request(NAME, handle) == OK
        assert final == S.GenerateFinished
        assert tokens == hf_ref(hf, prompt, 48), (form, case)


def test_status_sequence_and_stat_info(api, monkeypatch):
    engine, _, hf = api
    monkeypatch.setattr(engine_module, "ResultQueue", RecordingQueue)
    monkeypatch.setattr(client_module, "ResultQueue", RecordingQueue)
    prompt = PROMPTS[1]
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=48))
    assert status == OK and isinstance(queue, RecordingQueue)
    seen = []
    try:
        tokens = []
        while (el := queue.Get()) is not None:
            tokens.extend(el.ids_from_generate)
            seen.append(queue.GenerateStatus())
            assert queue.GeneratedLength() >= len(tokens)
    finally:
        assert engine.release_request(NAME, handle) == OK
    assert tokens == hf_ref(hf, prompt, 48)
    assert queue.GenerateStatus() == S.GenerateFinished and queue.GeneratedLength() == 48
    # strictly forward through Init -> ContextFinished -> Generating -> GenerateFinished
    h = queue.history
    assert h[0] == S.Init and h[-1] == S.GenerateFinished and h == sorted(set(h)), h
    assert set(h) <= {S.Init, S.ContextFinished, S.Generating, S.GenerateFinished}, h
    assert S.Generating in h or S.ContextFinished in h, h
    assert all(s in (S.ContextFinished, S.Generating, S.GenerateFinished) for s in seen), seen
    # after the end: nothing more, and no blocking
    assert queue.Get() is None and queue.GetNoWait() is None and queue.GetWithTimeout(10_000) is None
    info = queue.RequestStatInfo()
    assert info["context_token_length"] == len(prompt) and info["generated_token_length"] == 48
    assert 0 < info["arrival_time"] <= info["first_token_time"] <= info["last_token_time"] <= info["finished_time"]
    assert info["time_to_first_token"] == info["first_token_time"] - info["arrival_time"]


def test_get_no_wait_and_with_timeout(api):
    engine, _, hf = api
    prompt = PROMPTS[0]
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=20))
    assert status == OK
    try:
        first = queue.GetWithTimeout(int(HANG_S * 1000))
        assert first is not None and len(first.ids_from_generate) >= 1
        assert engine.sync_request(NAME, handle) == OK
        assert queue.GenerateStatus() == S.GenerateFinished and queue.GeneratedLength() == 20
        rest = queue.GetNoWait()            # everything since the last call, in one piece
        tokens = first.ids_from_generate + (rest.ids_from_generate if rest is not None else [])
        assert tokens == hf_ref(hf, prompt, 20)
        assert queue.GetNoWait() is None and queue.GetWithTimeout(10_000) is None and queue.Get() is None
    finally:
        assert engine.release_request(NAME, handle) == OK


# ------------------------------------------------------------------------------------------------
# sampling parameters
# ------------------------------------------------------------------------------------------------

_engine_refs: dict = {}


def in_process_reference(request, prompt, gen) -> list[int]:
    """The same request on the in-process Engine (served_llama), computed once per (prompt, gen)."""
    key = (tuple(prompt), json.dumps(gen, sort_keys=True))
    if key not in _engine_refs:
        engine, _ = request.getfixturevalue("served_llama")
        _engine_refs[key] = run(engine, prompt, gen)[0]
    return _engine_refs[key]


def test_seed_reproducible(api, request):
    engine, _, _ = api
    prompt = random_prompt(12, seed=7201)
    a = run(engine, prompt, dict(SAMPLING, seed=1))[0]
    b = run(engine, prompt, dict(SAMPLING, seed=1))[0]
    c = run(engine, prompt, dict(SAMPLING, seed=2))[0]
    assert len(a) == 24 and a == b and a != c
    # the same seeds, concurrently in one batch: the same streams
    started = [engine.start_request(NAME, {"input_ids": prompt}, dict(SAMPLING, seed=s)) for s in (1, 2, 1)]
    try:
        assert all(st == OK for st, _, _ in started), engine.get_last_error()
        outs = [collect(q, HANG_S)[0] for _, _, q in started]
    finally:
        for st, h, _ in started:
            if st == OK:
                assert engine.release_request(NAME, h) == OK
    assert outs == [a, c, a]
    assert a == in_process_reference(request, prompt, dict(SAMPLING, seed=1))


EOS_HALF = list(range(0, VOCAB, 2))        # every even token ends the request (unless min_length forbids it)
PENALTY_CASES = {       # name: (the case's keys, the keys of its baseline without the parameter under test)
    "repetition": ({"repetition_penalty": 1.3}, {}),
    "presence_frequency": ({"presence_penalty": 0.5, "frequency_penalty": 0.3}, {}),
    "min_length": ({"min_length": 20, "eos_token_id": EOS_HALF}, {"eos_token_id": EOS_HALF}),
    "all": ({"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 0.7, "min_length": 16,
             "eos_token_id": EOS_HALF}, {"eos_token_id": EOS_HALF}),
}


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_sampled_penalties_same_on_both_engines(api, request, case):
    """Sampled (seeded) with penalties / min_length: the pool draws exactly what the Engine draws."""
    engine, _, _ = api
    prompt = random_prompt(10, seed=7301)
    keys, base_keys = PENALTY_CASES[case]
    gen = dict(SAMPLING, seed=11, **keys)
    ours = run(engine, prompt, gen)[0]
    assert ours == in_process_reference(request, prompt, gen)
    assert ours == run(engine, prompt, gen)[0]                    # and the same again
    assert ours != run(engine, prompt, dict(SAMPLING, seed=11, **base_keys))[0], "the keys should change the draw"
    if "min_length" in keys:        # no EOS before min_length (prompt 10 + 10 or 6 outputs), then the first ends it
        free = keys["min_length"] - len(prompt)
        assert len(ours) >= free and not any(t % 2 == 0 for t in ours[:free - 1])
        assert len(ours) == 24 or (ours[-1] % 2 == 0 and not any(t % 2 == 0 for t in ours[:-1]))
    else:
        assert len(ours) == 24


def test_greedy_repetition_penalty_matches_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=41)

    def rep(ids, out, lg, p=1.3):
        lg = lg.clone()
        seen = torch.tensor(sorted(set(ids)))
        vals = lg[seen]
        lg[seen] = torch.where(vals > 0, vals / p, vals * p)
        return lg

    ref = hf_loop(hf, prompt, 24, rep)
    assert ref != hf_ref(hf, prompt, 24)
    assert run(engine, prompt, dict(GREEDY, repetition_penalty=1.3, max_new_tokens=24))[0] == ref


def test_greedy_presence_frequency_match_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=43)

    def pf(ids, out, lg):
        lg = lg.clone()
        for tok, count in Counter(out).items():
            lg[tok] -= 0.3 * count + 0.5
        return lg

    ref = hf_loop(hf, prompt, 24, pf)
    assert ref != hf_ref(hf, prompt, 24)
    tokens = run(engine, prompt, {"do_sample": False, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                  "max_new_tokens": 24, "eos_token_id": []})[0]
    assert tokens == ref


def test_min_length_matches_hf_loop(api):
    engine, _, hf = api
    prompt = random_prompt(8, seed=45)
    first = int(torch.argmax(hf_logits(hf, prompt)[-1]))
    # without min_length the request ends at once on its EOS (included in the output)
    assert run(engine, prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first]})[0] == [first]
    min_length = len(prompt) + 5

    def mask(ids, out, lg):
        lg = lg.clone()
        if len(ids) < min_length:
            lg[first] = float("-inf")
        return lg

    ref = hf_loop(hf, prompt, 16, mask, eos=(first,))
    tokens = run(engine, prompt, {"top_k": 1, "max_new_tokens": 16, "eos_token_id": [first],
                                  "min_length": min_length})[0]
    assert first not in tokens[:5] and tokens == ref


def test_eos_stop_words_and_lengths(api):
    engine, _, hf = api
    prompt = random_prompt(10, seed=6)
    ref = hf_ref(hf, prompt, 20)
    # max_length is the total (prompt + output): 10 + 5
    assert run(engine, prompt, dict(GREEDY, max_length=15))[0] == ref[:5]
    # the tighter of max_length / max_new_tokens wins, either way round
    assert run(engine, prompt, dict(GREEDY, max_length=200, max_new_tokens=4))[0] == ref[:4]
    assert run(engine, prompt, dict(GREEDY, max_length=13, max_new_tokens=10))[0] == ref[:3]
    # eos: stops at (and includes) the first occurrence of any eos id
    eos = ref[6]
    out = run(engine, prompt, dict(GREEDY, max_new_tokens=20, eos_token_id=[eos, 3]))[0]
    stop = min(i for i, t in enumerate(ref) if t in (eos, 3))
    assert out == ref[:stop + 1]
    # an int eos is accepted too
    assert run(engine, prompt, dict(GREEDY, max_new_tokens=20, eos_token_id=eos))[0] == out
    # stop words: the output ends with the matched sequence
    seq = ref[8:10]
    stop_at = next(i for i in range(1, 20) if ref[i - 1:i + 1] == seq)
    out = run(engine, prompt, dict(GREEDY, max_new_tokens=20, stop_words_ids=[[511, 510], seq]))[0]
    assert out == ref[:stop_at + 1]


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------

def test_logprobs_match_hf(api):
    engine, _, hf = api
    prompt = random_prompt(9, seed=31)
    n = 16
    tokens, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=n, logprobs=True, top_logprobs=5))
    assert tokens == hf_ref(hf, prompt, n)
    token_lp, top_lp = [], []
    for el in elements:
        assert len(el.token_logprobs_list) == len(el.ids_from_generate) == len(el.log_probs_list)
        token_lp.extend(el.token_logprobs_list)
        top_lp.extend(el.log_probs_list)
    ref = torch.log_softmax(hf_logits(hf, prompt + tokens[:-1]), -1)[len(prompt) - 1:]      # [n, V]
    for i, tok in enumerate(tokens):
        assert token_lp[i] == pytest.approx(float(ref[i, tok]), abs=1e-4)
        pairs = top_lp[i]
        assert len(pairs) == 5 and all(isinstance(t, int) and isinstance(v, float) for t, v in pairs)
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        assert pairs[0][0] == tok
        hf_top = torch.topk(ref[i], 5)
        assert [t for t, _ in pairs] == hf_top.indices.tolist()
        assert values == pytest.approx(hf_top.values.tolist(), abs=1e-4)
    # logprobs without top_logprobs: the chosen token's logprob, empty top lists
    tokens3, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=3, logprobs=True))
    assert tokens3 == tokens[:3]
    assert [lp for el in elements for lp in el.token_logprobs_list] == pytest.approx(token_lp[:3], abs=1e-6)
    assert [x for el in elements for x in el.log_probs_list] == [[]] * 3
    # logprobs off: nothing reported
    _, elements, _ = run(engine, prompt, dict(GREEDY, max_new_tokens=3))
    assert all(el.token_logprobs_list == [] and el.log_probs_list == [] for el in elements)


# ------------------------------------------------------------------------------------------------
# stop / release / sync
# ------------------------------------------------------------------------------------------------

def test_stop_mid_stream(api):
    engine, _, hf = api
    prompt = random_prompt(8, seed=7401)
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=400))
    assert status == OK
    try:
        first = queue.GetWithTimeout(int(HANG_S * 1000))
        assert first is not None and len(first.ids_from_generate) >= 1
        assert engine.stop_request(NAME, handle) == OK
        # (that the status is final as soon as stop_request returns: test_stop_request_is_final_when_it_returns)
        assert engine.sync_request(NAME, handle) == OK
        assert queue.GenerateStatus() == S.GenerateFinished
        n = queue.GeneratedLength()
        tokens = list(first.ids_from_generate)
        while (el := queue.GetNoWait()) is not None:
            tokens.extend(el.ids_from_generate)
        assert len(tokens) == n < 400
        k = min(n, 48)
        assert tokens[:k] == hf_ref(hf, prompt, 48)[:k]
        assert_serves(engine, hf)             # time passes, other requests run: the stopped one stays still
        assert queue.GeneratedLength() == n and queue.GetNoWait() is None and queue.Get() is None
        assert engine.stop_request(NAME, handle) == OK        # stopping a stopped request is fine
    finally:
        assert engine.release_request(NAME, handle) == OK
    assert engine.release_request(NAME, handle) == ILLEGAL      # twice
    assert "unknown or released request handle" in engine.get_last_error()
    assert engine.stop_request(NAME, handle) == ILLEGAL
    assert engine.sync_request(NAME, handle) == ILLEGAL


def test_stop_request_is_final_when_it_returns(api, request, monkeypatch):
    """stop_request returns once no more tokens can arrive, however slowly the final status travels."""
    engine, _, hf = api
    monkeypatch.setattr(client_module, "ResultQueue", DelayedTerminalQueue)
    prompt = random_prompt(8, seed=7402)
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, dict(GREEDY, max_new_tokens=400))
    assert status == OK
    try:
        assert queue.GetWithTimeout(int(HANG_S * 1000)) is not None
        assert engine.stop_request(NAME, handle) == OK
        assert queue.GenerateStatus() == S.GenerateFinished
    finally:
        assert engine.sync_request(NAME, handle) == OK
        assert engine.release_request(NAME, handle) == OK


def test_release_while_the_final_status_is_in_transit(api, monkeypatch):
    """All tokens are in, the final status is still on its way: release_request succeeds, once."""
    engine, _, hf = api
    monkeypatch.setattr(client_module, "ResultQueue", DelayedTerminalQueue)
    status, handle, queue = engine.start_request(NAME, {"input_ids": PROBE}, dict(GREEDY, max_new_tokens=4))
    assert status == OK
    tokens = []
    try:
        deadline = time.monotonic() + HANG_S
        while len(tokens) < 4:
            assert time.monotonic() < deadline, "no tokens (hang?)"
            el = queue.GetWithTimeout(1000)
            tokens.extend(el.ids_from_generate if el is not None else [])
    finally:
        assert engine.release_request(NAME, handle) == OK, engine.get_last_error()
    assert engine.release_request(NAME, handle) == ILLEGAL
    assert tokens == hf_ref(hf, PROBE, 8)[:4]
    assert queue.GenerateStatus() == S.GenerateFinished and queue.GeneratedLength() == 4
    assert queue.GetNoWait() is None


def test_unknown_handle(api):
    engine, _, hf = api
    for handle in (RequestHandle(NAME, 987654), RequestHandle("other", 1), 987654, "abc"):
        for call in (engine.stop_request, engine.release_request, engine.sync_request):
            assert call(NAME, handle) == ILLEGAL, (call.__name__, handle)
            msg = engine.get_last_error()
            assert "unknown or released request handle" in msg and repr(handle) in msg, msg
    assert_serves(engine, hf)


def test_sync_one_and_all(api):
    engine, _, hf = api
    prompts = [random_prompt(5 + i, seed=7500 + i) for i in range(3)]
    lengths = [16, 24, 32]
    started = [engine.start_request(NAME, {"input_ids": p}, dict(GREEDY, max_new_tokens=n))
               for p, n in zip(prompts, lengths)]
    try:
        assert all(st == OK for st, _, _ in started), engine.get_last_error()
        _, h0, q0 = started[0]
        assert engine.sync_request(NAME, h0) == OK
        assert q0.GenerateStatus() == S.GenerateFinished and q0.GeneratedLength() == 16
        done = []
        t = threading.Thread(target=lambda: done.append(engine.sync_request(NAME, None)), daemon=True)
        t.start()
        t.join(HANG_S)
        assert not t.is_alive() and done == [OK]
        for (_, _, q), p, n in zip(started, prompts, lengths):
            assert q.GenerateStatus() == S.GenerateFinished and q.GeneratedLength() == n
            assert q.GetNoWait().ids_from_generate == hf_ref(hf, p, n)
    finally:
        for st, h, _ in started:
            if st == OK:
                assert engine.release_request(NAME, h) == OK
    assert engine.sync_request(NAME, None) == OK          # nothing live: returns at once


# ------------------------------------------------------------------------------------------------
# error paths
# ------------------------------------------------------------------------------------------------

BAD_GEN = [
    ({"foo_bar": 1}, "foo_bar"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_logprobs": 11}, "top_logprobs"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, VOCAB]}, "eos_token_id"),
    ({"stop_words_ids": [[3], [VOCAB + 5]]}, "stop_words_ids"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
]


def test_bad_generation_config(api):
    engine, _, hf = api
    for gen, key in BAD_GEN:
        refused(engine, {"input_ids": PROBE}, dict(gen, max_new_tokens=4), PARAM, key)
    assert_serves(engine, hf)


def test_bad_prompts_and_lengths(api):
    engine, _, hf = api
    gen = dict(GREEDY, max_new_tokens=4)
    for empty in ([], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.long)):
        refused(engine, {"input_ids": empty}, gen, AsStatus.ALLSPARK_EMPTY_REQUEST, "empty")
    refused(engine, {"input_ids": [5, VOCAB, 6]}, gen, PARAM, "input_ids", str(VOCAB))
    refused(engine, {"input_ids": [5, -1]}, gen, PARAM, "input_ids")
    refused(engine, {"ids": [5]}, gen, PARAM, "input_ids")
    too_long = random_prompt(ENGINE_MAX_LENGTH + 1, seed=7601)
    refused(engine, {"input_ids": too_long}, {"top_k": 1}, EXCEED, str(ENGINE_MAX_LENGTH + 1))
    refused(engine, {"input_ids": PROBE}, dict(GREEDY, max_length=ENGINE_MAX_LENGTH + 1), EXCEED,
            "max_length", str(ENGINE_MAX_LENGTH))
    refused(engine, {"input_ids": PROBE}, dict(GREEDY, max_length=len(PROBE)), EXCEED, "max_length")
    # exactly engine_max_length is fine
    tokens = run(engine, PROBE, dict(GREEDY, max_length=ENGINE_MAX_LENGTH, max_new_tokens=3))[0]
    assert tokens == hf_ref(hf, PROBE, 8)[:3]
    assert_serves(engine, hf)


def outcome(engine, gen, key: str):
    """('OK', tokens) or (status, None); a refusal must name `key`. Raises if start_request raises."""
    status, handle, queue = engine.start_request(NAME, {"input_ids": PROBE}, gen)
    if status != OK:
        assert handle is None and key in engine.get_last_error(), (status, engine.get_last_error())
        return status.name, None
    try:
        tokens, _, final = collect(queue, HANG_S)
    finally:
        assert engine.release_request(NAME, handle) == OK
    assert final == S.GenerateFinished
    return "OK", tokens


def test_huge_integers_get_a_status(api, request):
    """Integers beyond int64 in the generation config get the same answer (a status) from both engines,
    never an exception."""
    engine, _, hf = api
    huge = 2**70
    cases = [("max_length", dict(GREEDY, max_length=huge)),
             ("max_new_tokens", dict(GREEDY, max_new_tokens=huge, max_length=len(PROBE) + 5)),
             ("min_length", dict(GREEDY, min_length=huge, max_new_tokens=5)),
             ("top_k", dict(SAMPLING, top_k=huge, seed=5))]
    in_process, _ = request.getfixturevalue("served_llama")
    for key, gen in cases:
        ours = outcome(engine, gen, key)
        assert ours == outcome(in_process, gen, key), key
        if ours[0] == "OK":         # accepted: an unreachable limit / a top_k beyond the vocabulary is off
            expected = (in_process_reference(request, PROBE, dict(gen, top_k=0)) if key == "top_k"
                        else hf_ref(hf, PROBE, 8)[:5])
            assert ours[1] == expected, key
        elif key == "max_length":
            assert ours[0] in ("ALLSPARK_EXCEED_LIMIT_ERROR", "ALLSPARK_PARAM_ERROR")


def test_config_forms_numpy_scalars_and_builder(api):
    engine, loader, hf = api
    prompt = PROMPTS[0]
    gen = {"top_k": np.int64(1), "max_new_tokens": np.int32(6), "temperature": np.float32(0.5),
           "eos_token_id": np.int64(VOCAB - 1)}
    ref6 = hf_ref(hf, prompt, 6)
    assert run(engine, prompt, gen)[0] == (ref6[:ref6.index(VOCAB - 1) + 1] if VOCAB - 1 in ref6 else ref6)
    # DashInfer's builder, filled from the model: eos 1, max_length from the runtime config
    builder = loader.create_reference_generation_config_builder(own_model_cfg(loader, "unused"))
    builder.update({"top_k": 1, "max_new_tokens": 24})
    status, handle, queue = engine.start_request(NAME, {"input_ids": prompt}, builder)
    assert status == OK, engine.get_last_error()
    try:
        tokens, _, final = collect(queue, HANG_S)
    finally:
        assert engine.release_request(NAME, handle) == OK
    ref = hf_ref(hf, prompt, 24)
    assert final == S.GenerateFinished and tokens == ref[:len(tokens)]
    assert len(tokens) == 24 or (tokens[-1] == 1 and 1 not in tokens[:-1])
    # the inert DashInfer keys with their "off" values are accepted
    inert = dict(GREEDY, max_new_tokens=3, num_beams=1, num_return_sequences=1, no_repeat_ngram_size=0,
                 bad_words_ids=[], lora_name="", early_stopping=True, length_penalty=1.0)
    assert run(engine, prompt, inert)[0] == ref[:3]


def test_last_error_is_per_thread_and_text_must_be_str(api):
    engine, loader, hf = api
    refused(engine, {"input_ids": PROBE}, {"main_thread_marker": 1}, PARAM, "main_thread_marker")
    other = []

    def in_other_thread():
        st, handle, _ = engine.start_request(NAME, {"input_ids": PROBE}, {"other_thread_marker": 1})
        other.append((st, engine.get_last_error()))
        if st == OK:
            engine.release_request(NAME, handle)

    t = threading.Thread(target=in_other_thread)
    t.start()
    t.join(HANG_S)
    assert other and other[0][0] == PARAM and "other_thread_marker" in other[0][1]
    assert "main_thread_marker" in engine.get_last_error()
    st, handle, queue = engine.start_request_text(NAME, loader, [5, 6, 7], GREEDY)
    assert (st, handle, queue) == (PARAM, None, None) and "str" in engine.get_last_error()
    assert_serves(engine, hf)
