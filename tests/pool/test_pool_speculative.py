"""Speculative decoding through a real 2-rank pool and ClientEngine (docs/speculative.md): the session's `pool`
serves the tiny Llama as "llama" without speculation and, installed next to it for this module, as "llama_spec"
with ngram speculation (4 tokens). Greedy tokens of both are the same, alone and three requests at once; the
spec_* stats come back through get_as_engine_stat; a request with speculative=False runs without it and counts as
skipped. A draft model (the tiny Llama's int8 copy, on rank 0) keeps greedy output in the pool too."""
from __future__ import annotations

import pytest
from helpers import assert_same_tokens, collect, random_prompt

from allspark_client import GenerateRequestStatus
from allspark_client.types import AsStatus

PLAIN, SPEC = "llama", "llama_spec"
NEW_TOKENS = 80


@pytest.fixture(scope="module")
def spec_pool(pool):
    """The session's pool client with SPEC installed and started (ngram, 4 tokens); released at the end."""
    client, loader = pool
    cfg = (loader.create_reference_runtime_config_builder(SPEC, "cpu", [0], max_batch=4)
           .max_length(512).kv_cache_span_size(16).speculative_decoding("ngram", 4).build())
    assert client.install_model(cfg) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    assert client.start_model(SPEC) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    try:
        assert '"world_size": 2' in client.get_model_info(SPEC)
        yield client
    finally:
        assert client.stop_model(SPEC) == AsStatus.ALLSPARK_SUCCESS
        assert client.release_model(SPEC) == AsStatus.ALLSPARK_SUCCESS


def repeating_prompt(seed: int) -> list[int]:
    """40 random tokens and their first 20 again: prompt lookup has a run to propose from the first decode on."""
    p = random_prompt(40, seed)
    return p + p[:20]


def greedy(n: int = NEW_TOKENS, **extra) -> dict:
    return {"top_k": 1, "max_new_tokens": n, "eos_token_id": [], **extra}


def run_all(client, name: str, prompts: list[list[int]], gen: dict) -> list[list[int]]:
    """Start every prompt at once (they share steps), then read each stream to its end."""
    started = []
    for ids in prompts:
        status, handle, queue = client.start_request(name, {"input_ids": ids}, gen)
        assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
        started.append((handle, queue))
    out = []
    for handle, queue in started:
        tokens, _, final = collect(queue, timeout_s=120)
        assert final == GenerateRequestStatus.GenerateFinished, (final, queue.ErrorMessage())
        assert client.release_request(name, handle) == AsStatus.ALLSPARK_SUCCESS
        out.append(tokens)
    return out


def test_greedy_alone_equals_no_speculation_and_stats(spec_pool):
    client = spec_pool
    before = client.get_as_engine_stat(SPEC)
    ids = repeating_prompt(11)
    [want] = run_all(client, PLAIN, [ids], greedy())
    [got] = run_all(client, SPEC, [ids], greedy())
    assert len(want) == NEW_TOKENS
    assert_same_tokens(got, want, "ngram speculation, one request")
    stat = client.get_as_engine_stat(SPEC)
    drafted = stat.spec_draft_tokens - before.spec_draft_tokens
    assert drafted > 0, stat
    assert 0 < stat.spec_acceptance_rate <= 1, stat
    assert 0 <= stat.spec_accepted_tokens <= stat.spec_draft_tokens, stat
    assert stat.spec_verify_steps > before.spec_verify_steps, stat
    # each verify step emits its accepted tokens and one of the model's own
    assert stat.spec_emitted_tokens == stat.spec_accepted_tokens + stat.spec_verify_steps, stat
    plain = client.get_as_engine_stat(PLAIN)
    assert (plain.spec_draft_tokens, plain.spec_verify_steps) == (0, 0), plain


def test_greedy_three_at_once_equals_no_speculation(spec_pool):
    client = spec_pool
    prompts = [repeating_prompt(seed) for seed in (21, 22, 23)]
    want = run_all(client, PLAIN, prompts, greedy())
    before = client.get_as_engine_stat(SPEC).spec_draft_tokens
    got = run_all(client, SPEC, prompts, greedy())
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_tokens(g, w, f"ngram speculation, request {i} of 3 at once")
    assert client.get_as_engine_stat(SPEC).spec_draft_tokens > before     # 3 <= speculative_max_batch (auto 4)


def test_request_turned_off_runs_without_speculation(spec_pool):
    client = spec_pool
    ids = repeating_prompt(31)
    [want] = run_all(client, PLAIN, [ids], greedy())
    before = client.get_as_engine_stat(SPEC)
    [got] = run_all(client, SPEC, [ids], greedy(speculative=False))
    assert_same_tokens(got, want, "speculative=False")
    stat = client.get_as_engine_stat(SPEC)
    assert (stat.spec_draft_tokens, stat.spec_verify_steps) == (before.spec_draft_tokens, before.spec_verify_steps)
    assert "turned_off=1" in stat.spec_skipped, stat.spec_skipped
    assert "turned_off" not in before.spec_skipped, before.spec_skipped


def test_draft_model_in_the_pool_keeps_greedy_output(pool, llama):
    """The draft method in a 2-rank pool: rank 0 runs the draft (the tiny Llama's own InstantQuant int8 copy),
    both ranks verify; greedy output alone and three at once equals the plain model's."""
    client, loader = pool
    name = "llama_draft"
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4)
           .max_length(512).kv_cache_span_size(16)
           .speculative_decoding("draft", 3, draft_model=llama.hf_dir, draft_quantize="int8").build())
    assert client.install_model(cfg) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    assert client.start_model(name) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    try:
        prompts = [random_prompt(30, seed) for seed in (41, 42, 43)]
        want = run_all(client, PLAIN, prompts, greedy(40))
        assert_same_tokens(run_all(client, name, prompts[:1], greedy(40))[0], want[0], "draft, one request")
        for i, (g, w) in enumerate(zip(run_all(client, name, prompts, greedy(40)), want)):
            assert_same_tokens(g, w, f"draft, request {i} of 3 at once")
        stat = client.get_as_engine_stat(name)
        assert stat.spec_verify_steps > 0 and stat.spec_acceptance_rate > 0.5, stat
    finally:
        assert client.stop_model(name) == AsStatus.ALLSPARK_SUCCESS
        assert client.release_model(name) == AsStatus.ALLSPARK_SUCCESS
