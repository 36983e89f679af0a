"""Continuous batching: requests joining at staggered times from many threads, chunked prefill and
preemption under a tiny KV budget must all give each request exactly the tokens it gets alone."""
from __future__ import annotations

import random
import threading
import time

import pytest
from helpers import collect, greedy, hf_greedy, random_prompt, serialize, start_engine

from allspark_server.step.kv_cache import bytes_per_span

PROMPT_LENS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 50, 64, 80, 100, 127, 150, 200, 250, 300, 333, 360, 399, 400]
NEW_TOKENS = [1 + (7 * i) % 48 for i in range(len(PROMPT_LENS))]   # 1..48, all different patterns


@pytest.fixture(scope="module")
def loader(llama, tmp_path_factory):
    return serialize(llama.hf_dir, "llama", str(tmp_path_factory.mktemp("batching")))


@pytest.fixture(scope="module")
def alone(loader, llama):
    """Reference: each request run by itself on its own engine (batch of one)."""
    engine = start_engine(loader, "alone", max_batch=1, max_length=512)
    out = [greedy(engine, "alone", random_prompt(n, seed=100 + i), NEW_TOKENS[i]) for i, n in enumerate(PROMPT_LENS)]
    # the reference itself agrees with transformers (spot check a short and a long one)
    for i in (0, 23):
        assert out[i] == hf_greedy(llama.model, random_prompt(PROMPT_LENS[i], seed=100 + i), NEW_TOKENS[i])
    return out


def run_concurrently(engine, name: str, num_threads: int = 6):
    results: dict[int, list[int]] = {}
    errors: list[str] = []
    order = list(range(len(PROMPT_LENS)))
    random.Random(0).shuffle(order)

    def worker(mine: list[int]):
        for i in mine:
            time.sleep(random.Random(i).uniform(0, 0.05))   # staggered arrivals while others run
            gen = {"top_k": 1, "max_new_tokens": NEW_TOKENS[i], "eos_token_id": []}
            status, handle, queue = engine.start_request(name, {"input_ids": random_prompt(PROMPT_LENS[i], 100 + i)},
                                                         gen)
            if status != 0:
                errors.append(engine.get_last_error())
                continue
            tokens, _, final = collect(queue)
            results[i] = tokens
            if final.name != "GenerateFinished":
                errors.append(f"request {i} ended {final.name}: {queue.ErrorMessage()}")
            engine.release_request(name, handle)

    threads = [threading.Thread(target=worker, args=(order[t::num_threads],)) for t in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return [results[i] for i in range(len(PROMPT_LENS))]


def test_batched_equals_alone(loader, alone):
    engine = start_engine(loader, "batched", max_batch=8, max_length=512, prefill=96)
    assert run_concurrently(engine, "batched") == alone
    stat = engine.get_as_engine_stat("batched")
    assert stat.num_preempted == 0 and stat.running_request == 0 and stat.used_span == 0
    assert stat.total_generated_token == sum(NEW_TOKENS)


def test_preemption_under_tiny_kv_budget_keeps_every_token(loader, alone, llama):
    args = loader.args
    # 36 spans of 16 tokens: the longest request (400 + 48 tokens = 28 spans) fits alone, few fit together
    budget = 36 * bytes_per_span(args.num_layers, 16, args.num_kv_heads, args.head_dim, loader.data_type)
    engine = start_engine(loader, "tight", max_batch=12, max_length=512, prefill=128, kv_bytes=budget)
    assert engine.get_as_engine_stat("tight").total_span == 36
    assert run_concurrently(engine, "tight", num_threads=12) == alone
    stat = engine.get_as_engine_stat("tight")
    assert stat.num_preempted > 0, "the budget was meant to force preemption"
    assert stat.used_span == 0 and stat.free_span == 36


def test_tokens_delivered_after_the_next_launch_are_the_same_tokens(loader, alone):
    """GPU ranks push a step's tokens once the next step is launched (ServedModel._defer_delivery); forced on here
    on the CPU: every request still gets exactly its tokens and its final status, a stopped request ends with
    what it had produced, and nothing is left undelivered when the engine goes idle."""
    engine = start_engine(loader, "deferred", max_batch=8, max_length=512, prefill=96)
    served = engine._engine.models["deferred"]
    served._defer_delivery = True
    assert run_concurrently(engine, "deferred") == alone
    assert not served._undelivered
    status, handle, queue = engine.start_request("deferred", {"input_ids": random_prompt(20, 7)},
                                                 {"top_k": 1, "max_new_tokens": 400, "eos_token_id": []})
    assert status == 0
    first = queue.Get()                     # generating: stop it mid-stream
    assert engine.stop_request("deferred", handle) == 0
    tokens, _, final = collect(queue)
    assert final.name == "GenerateFinished" and 0 < len(first.ids_from_generate) + len(tokens) < 400
    engine.release_request("deferred", handle)
    assert not served._undelivered and engine.get_as_engine_stat("deferred").used_span == 0
