"""The HTTP server's benchmark: a Poisson load through allspark-serve with the official `openai` async client, next
to the same workload through the Python `Engine` API directly.

    python benchmarks/serve.py [--quick] [--requests 64] [--rate 2.0] [--repeats 3] [--sequential 16]
                               [--json PATH]
    python benchmarks/serve.py --quick --burst 200 [--server-args "--max-concurrent 16 --max-queue 32"]

vLLM's benchmark_serving definitions: TTFT (request sent -> first token), TPOT ((last - first token) / (output
tokens - 1)), ITL (gaps between consecutive token arrivals), e2e latency; median and p99; request and output-token
throughput. A "token arrives" when its text does: the server streams text, and holds back a token that ends in an
incomplete UTF-8 character (the random model emits many) until the next completes it, so the direct Engine path
detokenizes its ids with the server's IncrementalDetokenizer and stamps the same moments (stamping ids there
instead put a whole decode step, ~90 ms, into the server's "overhead").
`--sequential N` first sends N requests one at a time down both paths: the server's own added latency, with no
queueing in the numbers. Prompts are token ids (the completions endpoint takes them), `max_tokens` tokens each with EOS
ignored, so both paths do identical work. The model: the Llama-shaped random bf16 model of run.py (0.5 B; --quick:
the small one) with a 512-token vocabulary, so every id it emits is one the trained test tokenizer can detokenize.
The server's Engine and the direct Engine run with the same thread count (`--threads`), never at once: both are
up for the whole run, and the Poisson load runs `--repeats` times with other arrival times, the paths alternating
which goes first; the medians are over every repeat's requests (one Poisson run's TTFT median moves by tens of ms
with the arrival times: a request that lands on another's prefill waits a whole prefill).
`--burst N` instead sends N streaming requests at once through HTTP only and counts how each ended: completed with
all its tokens, refused with 429, failed otherwise, or lost (no end within the timeout).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.spin_openmp()    # before torch loads, as run.py (the server started from here inherits it)

import workloads as W  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(results: list[dict], wall: float) -> dict:
    itl = [g for r in results for g in r["itl"]]
    out = {"requests": len(results), "wall_s": wall, "request_throughput": len(results) / wall,
           "output_throughput": sum(r["tokens"] for r in results) / wall}
    for key, xs in (("ttft", [r["ttft"] for r in results]), ("tpot", [r["tpot"] for r in results]),
                    ("itl", itl), ("e2e", [r["e2e"] for r in results])):
        if not xs:        # no gaps: every request's text came in one piece (a short run; the detokenizer holds back)
            continue
        out[f"{key}_median_ms"] = 1e3 * statistics.median(xs)
        out[f"{key}_p99_ms"] = 1e3 * _pct(xs, 0.99)
    return out


def ratio(a: float, b: float) -> float:
    """a / b; NaN where b is 0 (a short run's text can come in one piece: no time between its first and last)."""
    return a / b if b else float("nan")


def arrivals(n: int, rate: float, seed: int = 7) -> list[float]:
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def _record(t0: float, stamps: list[float], tokens: int) -> dict:
    """From the arrival times of the chunks (a chunk may carry several tokens) and the output token count."""
    return {"ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / max(1, tokens - 1), "e2e": stamps[-1] - t0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


async def http_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert tokens == max_tokens, tokens
    return _record(t0, stamps, tokens)


async def http_load(base_url: str, model: str, prompts: list[list[int]], at: list[float], max_tokens: int):
    """Each prompt sent at its arrival time (`at`, seconds from the start), all concurrently: (results, wall)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        return await http_request(client, model, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, at)))
    await client.close()
    return list(results), time.perf_counter() - start


async def http_warmup(base_url: str, model: str, vocab: int, prompt_len: int, max_tokens: int, n: int = 8) -> None:
    """n requests at once before measuring, as the direct path's rate measurement warms its Engine (a fresh
    server's first requests pay its first touches of the weights: 4 ms more per token, measured)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    await asyncio.gather(*(http_request(client, model, W.prompt(prompt_len, 9000 + i, vocab), max_tokens)
                           for i in range(n)))
    await client.close()


async def http_sequential(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    results = [await http_request(client, model, p, max_tokens) for p in prompts]
    await client.close()
    return summarize(results, time.perf_counter() - start)


def engine_request(engine, name: str, tokenizer, prompt: list[int], max_tokens: int) -> dict:
    """One request through the Python Engine API, its ids detokenized as the server does (see the docstring)."""
    from allspark_server.http.detokenize import IncrementalDetokenizer
    t0 = time.perf_counter()
    status, handle, queue = engine.start_request(name, {"input_ids": prompt}, dict(W.GREEDY, max_new_tokens=max_tokens))
    assert status == 0, engine.get_last_error()
    detok = IncrementalDetokenizer(tokenizer, prompt)
    stamps, tokens = [], 0
    while (el := queue.Get()) is not None:
        if el.ids_from_generate:
            tokens += len(el.ids_from_generate)
            if detok.add(el.ids_from_generate):
                stamps.append(time.perf_counter())
    if detok.flush():
        stamps.append(time.perf_counter())
    engine.release_request(name, handle)
    return _record(t0, stamps, tokens)


def engine_sequential(engine, name: str, tokenizer, prompts: list[list[int]], max_tokens: int) -> dict:
    start = time.perf_counter()
    results = [engine_request(engine, name, tokenizer, p, max_tokens) for p in prompts]
    return summarize(results, time.perf_counter() - start)


def engine_load(engine, name: str, tokenizer, prompts: list[list[int]], at: list[float], max_tokens: int):
    """As http_load, through the Engine API: a thread per request, started at its arrival time."""
    results, threads = [None] * len(prompts), []

    def one(i):
        results[i] = engine_request(engine, name, tokenizer, prompts[i], max_tokens)

    start = time.perf_counter()
    for i, when in enumerate(at):
        delay = when - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return results, time.perf_counter() - start


async def http_burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                     timeout_s: float = 600) -> dict:
    """Every prompt at once, streaming: how each request ended."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)

    async def one(prompt):
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                     temperature=0, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            tokens = 0
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return "completed" if tokens == max_tokens else f"short ({tokens} tokens)"
        except openai.RateLimitError:
            return "429"
        except openai.APITimeoutError:
            return "lost"
        except openai.APIError as e:
            return f"error: {type(e).__name__}"

    start = time.perf_counter()
    ends = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    counts: dict[str, int] = {}
    for e in ends:
        counts[e] = counts.get(e, 0) + 1
    return {"requests": len(prompts), "wall_s": time.perf_counter() - start, "ended": counts}


def start_server(hf_dir: str, a, extra: list[str]):
    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "allspark_server.http", "--model", hf_dir, "--served-model-name", "bench",
           "--cache-dir", tempfile.mkdtemp(prefix="allspark-serve-cache-"), "--dtype", "bfloat16",
           "--max-batch", "32", "--max-length", str(a.prompt + a.max_tokens + 16), "--threads", str(a.threads),
           "--port", str(port), "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_ready(url: str, proc, timeout_s: float = 600) -> None:
    import httpx
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"allspark-serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("allspark-serve did not become ready")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    common.add_smoke_flag(p)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (0: measured, half the batch capacity)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                   help="engine threads, the server's and the direct Engine's (default: all cores but one)")
    p.add_argument("--repeats", type=int, default=3, help="Poisson loads per path, each with other arrival times")
    p.add_argument("--sequential", type=int, default=16, help="requests sent one at a time first (0: none)")
    p.add_argument("--burst", type=int, default=0, help="N streaming requests at once through HTTP only")
    p.add_argument("--server-args", default="", help="extra allspark-serve flags (e.g. admission limits)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/serve-<machine>.json "
                   "(--burst: serve-burst-<machine>.json; --quick: under results/quick/)")
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("serve-burst" if a.burst else "serve", quick=a.quick or a.smoke)
    spec = dict(common.spec_of(a), vocab=VOCAB)
    hf_dir = common.build_model(spec, "bfloat16")
    from allspark_server.loader.tiny_model import build_tokenizer
    if not os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        build_tokenizer(hf_dir)
    prompts = [W.prompt(a.prompt, 100 + i, VOCAB) for i in range(a.burst)]
    one_by_one = [W.prompt(a.prompt, 5000 + i, VOCAB) for i in range(a.sequential)]   # not the load's: no cache hits
    report = {"machine": common.machine_name(), "spec": spec, "threads": a.threads, "requests": a.burst or a.requests,
              "prompt": a.prompt, "max_tokens": a.max_tokens, "server_args": a.server_args}
    if a.burst:
        proc, base_url = start_server(hf_dir, a, a.server_args.split())
        try:
            report["burst"] = asyncio.run(http_burst(base_url, "bench", prompts, a.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(json.dumps(report["burst"]), flush=True)
        common.write_report(a.json, report)
        return

    import torch
    from transformers import AutoTokenizer

    from allspark_server import Engine, HuggingFaceModel
    torch.set_num_threads(a.threads)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    loader = HuggingFaceModel(hf_dir, "bench-serve", user_set_data_type="bfloat16")
    loader.load_model().serialize(None, model_output_dir=tempfile.mkdtemp(prefix="allspark-serve-")).free_model()
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("direct", "cpu", [0], max_batch=32)
           .max_length(a.prompt + a.max_tokens + 16).build())
    engine.install_model(cfg)
    engine.start_model("direct")
    # 8 requests at once: the warm-up (the server gets the same, http_warmup) and the rate's measure
    sustained = W.concurrent_tps(engine, "direct", VOCAB, 8, a.prompt, a.max_tokens)
    rate = a.rate or 0.5 * sustained / a.max_tokens   # half of what a batch of 8 sustains, as run.py's Poisson rows
    report["rate_rps"] = rate
    proc, base_url = start_server(hf_dir, a, a.server_args.split())
    try:
        asyncio.run(http_warmup(base_url, "bench", VOCAB, a.prompt, a.max_tokens))
        if one_by_one:
            report["engine_api_sequential"] = engine_sequential(engine, "direct", tokenizer, one_by_one, a.max_tokens)
            report["http_sequential"] = asyncio.run(http_sequential(base_url, "bench", one_by_one, a.max_tokens))
        # the Poisson load, `repeats` times with other arrival times, the two paths alternating which goes first
        # (the idle one waits: the server's engine and the direct one never run at once)
        runs = {"engine_api": [], "http": []}
        for r in range(a.repeats):
            at = arrivals(a.requests, rate, seed=7 + r)
            load = [W.prompt(a.prompt, 100 + 1000 * r + i, VOCAB) for i in range(a.requests)]  # no cache hits
            order = ("engine_api", "http") if r % 2 == 0 else ("http", "engine_api")
            for path in order:
                if path == "engine_api":
                    res = engine_load(engine, "direct", tokenizer, load, at, a.max_tokens)
                else:
                    res = asyncio.run(http_load(base_url, "bench", load, at, a.max_tokens))
                runs[path].append(res)
                print(f"repeat {r} {path}:", json.dumps(summarize(*res)), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        engine.stop_model("direct")
        engine.release_model("direct")
        engine.shutdown()
    for path, rs in runs.items():      # every repeat's requests together
        report[path] = summarize([x for res, _ in rs for x in res], sum(wall for _, wall in rs))
        report[path + "_repeats"] = [summarize(*res) for res in rs]
    e, h = report["engine_api"], report["http"]
    report["http_vs_engine"] = {"tpot_median_ratio": ratio(h["tpot_median_ms"], e["tpot_median_ms"]),
                                "ttft_median_added_ms": h["ttft_median_ms"] - e["ttft_median_ms"],
                                "output_throughput_ratio": ratio(h["output_throughput"], e["output_throughput"]),
                                "ttft_median_added_ms_per_repeat": [
                                    hr["ttft_median_ms"] - er["ttft_median_ms"]
                                    for er, hr in zip(report["engine_api_repeats"], report["http_repeats"])]}
    if one_by_one:
        e, h = report["engine_api_sequential"], report["http_sequential"]
        report["http_vs_engine_sequential"] = {"tpot_median_ratio": ratio(h["tpot_median_ms"], e["tpot_median_ms"]),
                                               "ttft_median_added_ms": h["ttft_median_ms"] - e["ttft_median_ms"]}
    print(json.dumps({k: v for k, v in report.items() if k.startswith("http_vs")}, indent=1))
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
