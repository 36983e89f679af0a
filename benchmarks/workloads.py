"""The benchmark workloads, for any engine with allspark's API (Engine, ClientEngine) and for
transformers' generate. Every function returns plain numbers (seconds, tokens/s)."""
from __future__ import annotations

import random
import statistics
import threading
import time

import torch

GREEDY = {"top_k": 1, "eos_token_id": []}   # ignore EOS: every request produces exactly its tokens
DECODE_PROMPT_LEN = 32                      # the prompt before a batch-1 decode measurement (every engine)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return random.Random(seed).choices(range(10, vocab), k=n)


def _run_one(engine, name: str, ids: list[int], new_tokens: int) -> dict:
    """Submit one request and time it: arrival -> first token -> last token."""
    t0 = time.perf_counter()
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, dict(GREEDY, max_new_tokens=new_tokens))
    assert status == 0, engine.get_last_error()
    first = last = None
    count = 0
    while (el := queue.Get()) is not None:
        now = time.perf_counter()
        if el.ids_from_generate:
            first = first or now
            last = now
            count += len(el.ids_from_generate)
    engine.release_request(name, handle)
    assert count == new_tokens, (count, new_tokens)
    # tokens that all came in one element (a reader slower than the steps) have no spacing: their time per token is
    # then the whole request's
    tpot = (last - first) / (count - 1) if count > 1 and last > first else (last - t0) / max(1, count)
    return {"ttft": first - t0, "tpot": tpot, "end": last, "start": t0}


def decode_tps(engine, name: str, vocab: int, new_tokens: int, seed: int = 0,
               prompt_len: int = DECODE_PROMPT_LEN) -> float:
    """Batch-1 decode tokens/s of one request (from first to last token) after a prompt of `prompt_len`."""
    return 1.0 / _run_one(engine, name, prompt(prompt_len, seed, vocab), new_tokens)["tpot"]


def greedy_tokens(engine, name: str, ids: list[int], new_tokens: int) -> list[int]:
    """The greedy continuation of `ids` (EOS ignored)."""
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, dict(GREEDY, max_new_tokens=new_tokens))
    assert status == 0, engine.get_last_error()
    out = []
    while (el := queue.Get()) is not None:
        out.extend(el.ids_from_generate)
    engine.release_request(name, handle)
    return out


def ttft_prompt(prompt_len: int, r: int, vocab: int, salt: int = 0) -> list[int]:
    """The r-th TTFT prompt of a length. Its seed depends on the length: prompts of one seed are prefixes of
    each other, so a 512-token prompt after the 128-token one of the same seed would find its first 128 tokens in
    the prefix cache (on by default). `salt` (< 1000) keeps another series of the same length apart."""
    return prompt(prompt_len, 1_000_000 * (1 + salt) + 1000 * prompt_len + r, vocab)


def ttft(engine, name: str, vocab: int, prompt_len: int, repeats: int) -> float:
    return statistics.median(first_token_s(engine, name, ttft_prompt(prompt_len, r, vocab)) for r in range(repeats))


def first_token_s(engine, name: str, ids: list[int]) -> float:
    """Seconds from submitting `ids` to its first generated token."""
    return _run_one(engine, name, ids, 1)["ttft"]


def concurrent_tps(engine, name: str, vocab: int, num: int, prompt_len: int, new_tokens: int) -> float:
    """Output tokens/s with `num` requests submitted together."""
    results = [None] * num

    def worker(i):
        results[i] = _run_one(engine, name, prompt(prompt_len, 200 + i, vocab), new_tokens)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return num * new_tokens / (time.perf_counter() - t0)


def decode_only_tps(stamps: list[list[float]]) -> float:
    """From requests' token arrival times (token_times_threads / token_times_one_loop): the tokens after the last
    request's first token over the time from then to the end."""
    all_first, end = max(t[0] for t in stamps), max(t[-1] for t in stamps)
    return sum(t > all_first for s in stamps for t in s) / (end - all_first)


def token_times_threads(engine, name: str, prompts: list[list[int]], new_tokens: int) -> list[list[float]]:
    """Start a request per prompt, each read by a thread of its own blocked in Get() (DashInfer's examples); each
    request's token arrival times."""
    stamps = [[] for _ in prompts]

    def one(i):
        status, handle, queue = engine.start_request(name, {"input_ids": prompts[i]},
                                                     dict(GREEDY, max_new_tokens=new_tokens))
        assert status == 0, engine.get_last_error()
        while (el := queue.Get()) is not None:
            stamps[i].extend([time.perf_counter()] * len(el.ids_from_generate))
        engine.release_request(name, handle)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stamps


def token_times_one_loop(engine, name: str, prompts: list[list[int]], new_tokens: int) -> list[list[float]]:
    """Start a request per prompt and read them all on one asyncio loop, as the HTTP server reads its streams
    (allspark_server.http.stream.QueueReader: one wake-up of the loop per engine step, no thread per stream);
    each request's token arrival times."""
    import asyncio

    from allspark_server.http.stream import QueueReader
    stamps = [[] for _ in prompts]
    handles = []

    async def one(i, w):
        while True:
            while w.items:
                stamps[i].extend([time.perf_counter()] * len(w.items.popleft().ids_from_generate))
            if w.done:
                return
            w.event.clear()
            await w.event.wait()

    async def main():
        reader, watches = QueueReader(), []
        for ids in prompts:
            status, handle, queue = engine.start_request(name, {"input_ids": ids},
                                                         dict(GREEDY, max_new_tokens=new_tokens))
            assert status == 0, engine.get_last_error()
            handles.append(handle)
            watches.append(reader.watch(queue))
        await asyncio.gather(*(one(i, w) for i, w in enumerate(watches)))
    asyncio.run(main())
    for handle in handles:
        engine.release_request(name, handle)
    return stamps


def poisson(engine, name: str, vocab: int, num: int, rate: float, prompt_len: int, new_tokens: int) -> dict:
    """Requests arriving as a Poisson process of `rate`/s; TTFT and TPOT (vLLM's definitions:
    TPOT = (last - first token) / (output tokens - 1)), median and p99, and output tokens/s."""
    rng = random.Random(7)
    results, threads = [], []
    t0 = time.perf_counter()
    at = 0.0
    for i in range(num):
        at += rng.expovariate(rate)
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=lambda i=i: results.append(
            _run_one(engine, name, prompt(prompt_len, 300 + i, vocab), new_tokens)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall = max(r["end"] for r in results) - t0
    ttfts = sorted(r["ttft"] for r in results)
    tpots = sorted(r["tpot"] for r in results)
    p99 = lambda xs: xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]   # noqa: E731
    return {"ttft_median": statistics.median(ttfts), "ttft_p99": p99(ttfts),
            "tpot_median": statistics.median(tpots), "tpot_p99": p99(tpots), "tps": num * new_tokens / wall}


# ---- transformers ------------------------------------------------------------------------------
def _hf_generate(model, batch: list[list[int]], new_tokens: int) -> float:
    x = torch.tensor(batch)
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t


def hf_decode_tps(model, vocab: int, new_tokens: int, seed: int = 0) -> float:
    """Decode rate = extra tokens / extra time between a 1-token and an N-token generate."""
    ids = [prompt(DECODE_PROMPT_LEN, seed, vocab)]
    return (new_tokens - 1) / (_hf_generate(model, ids, new_tokens) - _hf_generate(model, ids, 1))


def hf_ttft(model, vocab: int, prompt_len: int, repeats: int) -> float:
    return statistics.median(_hf_generate(model, [ttft_prompt(prompt_len, r, vocab)], 1) for r in range(repeats))


def hf_concurrent_tps(model, vocab: int, num: int, prompt_len: int, new_tokens: int) -> float:
    """transformers' static batching: all `num` prompts (same length) in one generate call."""
    batch = [prompt(prompt_len, 200 + i, vocab) for i in range(num)]
    return num * new_tokens / _hf_generate(model, batch, new_tokens)
