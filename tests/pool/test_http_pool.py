"""allspark-serve in front of a 2-rank pool it starts itself (--ranks 2), with admission limits of 2 running and
none queued: the `openai` client (sync and async, streaming and not) gets the in-process Engine's greedy output
through the pool; a model folder without a chat template answers chat with a 400; a burst of concurrent streams
gets 429s (with Retry-After) for the extras while every admitted one completes exactly — none lost or hung; SIGUSR1
prints the stacks of the server and its ranks while a stream runs on."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers import LONG_RUN_MAX_LENGTH
from http_helpers import Server, engine_greedy_text

PROMPT = "Hello world!"
BURST = 10
BURST_TOKENS = 96


@pytest.fixture(scope="module")
def server(llama):
    srv = Server(llama.hf_dir, "--ranks", "2", "--max-length", str(LONG_RUN_MAX_LENGTH), "--max-concurrent", "2",
                 "--max-queue", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(llama.hf_dir)


def test_openai_client_through_a_pool(server, served_llama, tokenizer):
    engine, _ = served_llama
    want, tokens = engine_greedy_text(engine, tokenizer, tokenizer(PROMPT)["input_ids"], 20)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["llama"]
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == want and r.usage.completion_tokens == len(tokens)
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        s = await aclient.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
        text = "".join([c.choices[0].text async for c in s])
        r = await aclient.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0)
        await aclient.close()
        return text, r.choices[0].text

    assert asyncio.run(run()) == (want, want)
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_without_a_template_is_a_400(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "no_chat_template"


def test_overload_gets_429_and_no_request_is_lost(server):
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": BURST_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient):
        async with client.stream("POST", server.base_url + "/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.headers.get("retry-after"), r.json()
            events = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
            return 200, None, events

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(BURST))), 180)

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == BURST, [r[0] for r in results]
    assert len(ok) >= 2 and len(refused) >= 1, [r[0] for r in results]
    for _, retry_after, err in refused:
        assert int(retry_after) >= 1 and err["error"]["code"] == "server_overloaded"
    for _, _, events in ok:                       # every admitted stream ran to its end
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == BURST_TOKENS
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    m = server.metrics()
    assert m["allspark_server_requests_admitted"] == 0 and m["allspark_server_requests_queued"] == 0
    assert m['allspark_http_requests_total{endpoint="/v1/completions",status="429"}'] == len(refused)
    for rank in "01":                              # the streams' decode steps, as each rank read them
        assert m[f'allspark_rank_memory_bandwidth_gbs{{model_name="llama",rank="{rank}"}}'] > 0
        assert m[f'allspark_rank_memory_bandwidth_utilization{{model_name="llama",rank="{rank}"}}'] > 0


def test_sigusr1_prints_every_stack_and_the_stream_runs_on(server):
    """SIGUSR1 to allspark-serve and its ranks while a stream runs (what Server.diagnosis does): each prints every
    thread's stack to its log (faulthandler) and goes on; the stream ends with all its tokens."""
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
        lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        events = [next(lines)]
        seen = server.diagnosis()
        events += list(lines)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 2000
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # the server's stacks (its main thread in allspark_server/http/cli.py), rank 0's (serving) and rank 1's (the
    # worker loop); whichever thread took the signal, faulthandler prints them all
    for frame in ("allspark_server/http/cli.py", "in serve", "in run_worker"):
        assert frame in seen, (frame, seen[-3000:])
    assert httpx.get(server.url + "/health").status_code == 200
