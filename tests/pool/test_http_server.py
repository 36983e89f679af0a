"""allspark-serve on an in-process Engine, as a real subprocess: the official `openai` client (sync and async,
streaming and not, chat and completions) gets the Engine's greedy output; stop strings, logprobs, guided output;
error bodies (400 / 401 / 404) through raw httpx; hostile bodies (413 for a huge one, 400 for lone surrogates, deep
nesting, unknown roles, prompts too long to tokenize) on a keep-alive connection that survives them; a client that
leaves mid-stream frees its engine request at once; /metrics parsed with prometheus-client. The session's chat
server (conftest's chat_llama_server: API key set, chat template added)."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from http_helpers import API_KEY, CHAT_MAX_LENGTH, engine_greedy_text, folder_tokenizer

MAX_LENGTH = CHAT_MAX_LENGTH
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def server(chat_llama_server):
    return chat_llama_server


@pytest.fixture(scope="module")
def tokenizer(server):
    return folder_tokenizer(server)                  # the server's own folder: with the chat template


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected_finish(tokens, tokenizer) -> str:
    return "stop" if tokens[-1] == tokenizer.eos_token_id else "length"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["llama"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completions_greedy_equals_engine(server, client, served_llama, tokenizer):
    engine, _ = served_llama
    want, tokens = engine_greedy_text(engine, tokenizer, tokenizer(PROMPT)["input_ids"], 24)
    assert len(tokens) >= 8, tokens        # a real continuation, not an immediate EOS
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == expected_finish(tokens, tokenizer)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tokenizer(PROMPT)["input_ids"]), len(tokens))
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected_finish(tokens, tokenizer)
    assert chunks[-1].usage.completion_tokens == len(tokens)
    ids = tokenizer(PROMPT)["input_ids"]            # a prompt of token ids
    assert client.completions.create(model="llama", prompt=ids, max_tokens=24, temperature=0).choices[0].text == want


def test_chat_greedy_equals_engine(server, client, served_llama, tokenizer):
    engine, _ = served_llama
    want, tokens = engine_greedy_text(engine, tokenizer, chat_ids(tokenizer), 20)
    r = client.chat.completions.create(model="llama", messages=MESSAGES, max_completion_tokens=20, temperature=0,
                                       user="someone")
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == expected_finish(tokens, tokenizer)
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer)) and r.usage.completion_tokens == len(tokens)
    stream = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == expected_finish(tokens, tokenizer)


def test_async_client_concurrent_streams(server, served_llama, tokenizer):
    engine, _ = served_llama
    prompts = [PROMPT, "Hello world!", "Once upon a time", "def main():"]
    want = [engine_greedy_text(engine, tokenizer, tokenizer(p)["input_ids"], 16)[0] for p in prompts]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)

        async def one(p, stream):
            if not stream:
                r = await aclient.completions.create(model="llama", prompt=p, max_tokens=16, temperature=0)
                return r.choices[0].text
            s = await aclient.chat.completions.create(model="llama", messages=[{"role": "user", "content": p}],
                                                      max_tokens=16, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in s])

        texts = await asyncio.gather(*(one(p, False) for p in prompts))
        chats = await asyncio.gather(*(one(p, True) for p in prompts))
        await aclient.close()
        return texts, chats

    texts, chats = asyncio.run(run())
    assert texts == want
    assert all(isinstance(c, str) for c in chats)


def test_stop_string_spanning_tokens_is_cut_exactly(server, client, tokenizer):
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=32, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    ids = tokenizer(PROMPT)["input_ids"]
    # token boundaries of the output: find two neighbouring ASCII pieces and a stop string across their boundary
    out_ids = client.completions.create(model="llama", prompt=PROMPT, max_tokens=32, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    stop, offset = None, 0
    for a, b in zip(out_ids, out_ids[1:]):
        if not (a + b).isascii() or not (a + b).isprintable():
            break                                   # past a byte token offsets in the text are not the pieces'
        offset += len(a)
        cand = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and offset >= 8 and text.find(cand) == offset - 2:
            stop = cand
            break
    assert stop is not None, (text, out_ids, ids)
    want = text[:text.find(stop)]
    assert len(want) >= 6
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "@@@@"],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=32, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(server, client):
    r = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)     # greedy: the chosen token is the best
    c = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def test_sampling_fields_pass_through(server, client):
    kw = dict(model="llama", prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5,
              frequency_penalty=0.3)
    extra = {"top_k": 20, "repetition_penalty": 1.1, "min_tokens": 12}
    a = client.completions.create(**kw, extra_body=extra)
    b = client.completions.create(**kw, extra_body=extra)
    assert a.choices[0].text == b.choices[0].text          # same seed, same output
    assert a.usage.completion_tokens == 12                 # min_tokens: no EOS before 12 tokens
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "regex", "regex": "(yes|no)"}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_n_choices(server, client, served_llama, tokenizer):
    engine, _ = served_llama
    ids = tokenizer(PROMPT)["input_ids"]
    want, tokens = engine_greedy_text(engine, tokenizer, ids, 16)
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, temperature=0, n=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(c.text == want for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 4 * len(tokens))   # the prompt once
    kw = dict(model="llama", messages=MESSAGES, max_completion_tokens=12, temperature=1.0, seed=5, n=3)
    texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert texts == [c.message.content for c in client.chat.completions.create(**kw).choices]   # seeded: the same
    assert len(set(texts)) > 1                                                   # each choice its own draws
    assert client.chat.completions.create(**{**kw, "n": 1}).choices[0].message.content == texts[0]
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed, finished = [""] * 3, [None] * 3
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert streamed == texts and None not in finished
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(tokenizer))
    # best_of: the choice of the highest mean logprob among those the same seed draws
    kw = dict(model="llama", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=9)
    three = client.completions.create(**kw, n=3, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(**kw, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == three.choices[means.index(max(means))].text
    assert best.usage.completion_tokens == three.usage.completion_tokens      # every token generated counts
    _error(server.post("/completions", {**kw, "n": 257}), 400, "n")


def _error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_errors_are_openai_error_objects(server):
    base = {"model": "llama", "prompt": PROMPT, "max_tokens": 4}
    _error(server.post("/completions", content=b'{"model": "llama", "prompt": '), 400)
    _error(server.post("/completions", {**base, "max_tokens": "four"}), 400, "max_tokens")
    _error(server.post("/completions", {**base, "temperature": [1]}), 400, "temperature")
    err = _error(server.post("/completions", {**base, "best_guess": 1}), 400, "best_guess")
    assert "best_guess" in err["message"]
    for n in (0, 129):
        _error(server.post("/chat/completions", {"model": "llama", "messages": MESSAGES, "n": n}), 400, "n")
    _error(server.post("/completions", {**base, "n": 3, "best_of": 2}), 400, "best_of")
    _error(server.post("/completions", {**base, "best_of": 2, "stream": True}), 400, "best_of")
    _error(server.post("/completions", {**base, "temperature": 500}), 400, "temperature")   # the engine's check
    _error(server.post("/completions", {**base, "model": "gpt-4"}), 404, "model")
    long_prompt = list(range(3, 400)) * 21                                  # 8337 tokens > max length 8192
    err = _error(server.post("/completions", {**base, "prompt": long_prompt}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    _error(server.post("/chat/completions", {"model": "llama", "messages": MESSAGES}, headers={}), 401)
    _error(server.post("/chat/completions", {"model": "llama", "messages": MESSAGES},
                       headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0).chat.completions.create(
            model="llama", messages=MESSAGES, n=0)


def _client_port(r: httpx.Response):
    """The local port of the connection that carried `r` (the same port, the same keep-alive connection); None
    when the server closed it."""
    try:
        return r.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:
        return None


def test_hostile_bodies_get_400s_naming_the_problem_on_a_connection_that_survives(server):
    deep = 100_000
    cases = [  # (path, raw body, param, words of the message)
        ("/completions", b'{"model": "llama", "prompt": "\\ud800abc", "max_tokens": 2}', "prompt",
         "lone UTF-16 surrogate"),
        ("/chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "a\\udc00"}]}',
         "messages[0].content", "lone UTF-16 surrogate"),
        ("/completions", b"[" * deep + b"]" * deep, None, "levels deep"),
        ("/chat/completions", b'{"model": "llama", "messages": [{"role": "robot", "content": "hi"}]}',
         "messages[0].role", "'robot'"),
    ]
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=60) as c:
        ports = set()
        for path, raw, param, words in cases:
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert words in _error(r, 400, param)["message"]
            ports.add(_client_port(r))
        r = c.post("/completions", json={"model": "llama", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        ports.add(_client_port(r))
    assert len(ports) == 1 and None not in ports   # one keep-alive connection carried all of them


def test_developer_messages_are_system_messages_to_a_template_without_that_role(server, client):
    def ask(role):
        r = client.chat.completions.create(model="llama", max_tokens=6, temperature=0, messages=[
            {"role": role, "content": "Be brief."}, {"role": "user", "content": "Hello world!"}])
        return r.choices[0].message.content, r.usage.prompt_tokens
    assert ask("developer") == ask("system")


def test_huge_bodies_are_refused_before_they_cost_memory(server):
    """A 20 MB body: 413 unread (default --max-body-mb 16); an 8 MB prompt under it: 400 before tokenizing. The
    server's RSS hardly moves (tokenizing either took GBs)."""
    import psutil
    rss = psutil.Process(server.proc.pid).memory_info
    before = rss().rss
    huge = "x" * 20_000_000
    err = _error(server.post("/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": huge}]}),
                 413)
    assert err["code"] == "request_too_large"

    def chunks():                                   # no Content-Length: refused once 16 MiB have arrived
        for _ in range(20):
            yield b"x" * 1_000_000
    assert _error(server.post("/completions", content=chunks()), 413)["code"] == "request_too_large"
    text = "x y " * 2_000_000
    for path, body, param in (("/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
                              ("/completions", {"prompt": text}, "prompt")):
        err = _error(server.post(path, {"model": "llama", **body}), 400, param)
        assert err["code"] == "context_length_exceeded" and "before tokenizing" in err["message"]
    assert rss().rss - before < 50 << 20


def _wait_idle(server, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (m['allspark_num_requests_running{model_name="llama"}'] == 0
                and m["allspark_server_requests_admitted"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_client_disconnect_frees_the_engine_request(server):
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": MAX_LENGTH - 16, "temperature": 0, "ignore_eos": True}
    aborted = server.metrics().get('allspark_request_finished_total{finished_reason="abort"}', 0)
    with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True},
                      headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:
                m = server.metrics()
                assert m['allspark_num_requests_running{model_name="llama"}'] == 1
                break                                   # leaving the block closes the connection mid-stream
    started = time.monotonic()
    m = _wait_idle(server)
    assert m['allspark_num_requests_running{model_name="llama"}'] == 0 and time.monotonic() - started < 5
    assert m['allspark_request_finished_total{finished_reason="abort"}'] == aborted + 1
    # a non-streaming request whose client gives up is stopped too
    with pytest.raises(httpx.ReadTimeout):
        server.post("/completions", body, timeout=1.0)
    m = _wait_idle(server)
    assert m['allspark_num_requests_running{model_name="llama"}'] == 0
    assert m['allspark_request_finished_total{finished_reason="abort"}'] == aborted + 2


def test_metrics(server, client):
    client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, temperature=0)
    client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, temperature=0)   # a prefix cache hit
    m = server.metrics()
    assert m['allspark_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 2
    assert m['allspark_http_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert m['allspark_http_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 1
    assert m["allspark_time_to_first_token_seconds_count"] >= 2
    assert m["allspark_e2e_request_latency_seconds_count"] >= 2
    assert m["allspark_time_per_output_token_seconds_count"] >= 1
    assert m["allspark_prompt_tokens_total"] > 0 and m["allspark_generation_tokens_total"] > 0
    assert m['allspark_kv_cache_spans_total{model_name="llama"}'] > 0
    assert 0 <= m['allspark_kv_cache_usage_ratio{model_name="llama"}'] <= 1
    assert 0 < m['allspark_prefix_cache_hit_rate{model_name="llama"}'] <= 1
    assert m['allspark_engine_up{model_name="llama"}'] == 1
    assert m['allspark_num_requests_waiting{model_name="llama"}'] == 0
    assert m['allspark_memory_bandwidth_gbs{model_name="llama"}'] > 0
    assert m['allspark_memory_bandwidth_utilization{model_name="llama"}'] >= 0
    assert m['allspark_rank_memory_bandwidth_gbs{model_name="llama",rank="0"}'] == \
        m['allspark_memory_bandwidth_gbs{model_name="llama"}']
