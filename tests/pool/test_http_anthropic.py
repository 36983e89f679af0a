"""The Anthropic Messages API of allspark-serve (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client: non-streamed and streamed answers equal the in-process Engine's greedy output on the prompt
transformers' chat template renders (and the server's OpenAI chat answer), the SSE event sequence parses in the SDK
with warnings as errors, stop sequences, token counts, a forced tool_use round trip, Anthropic-shaped errors and the
`x-api-key` header. The session's chat server (conftest's
chat_llama_server: API key set, chat template added)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from http_helpers import API_KEY, CHAT_MAX_LENGTH, engine_greedy_text, folder_tokenizer

pytestmark = pytest.mark.filterwarnings("error")
SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Hello world!"}]
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
MAX_TOKENS = 20
GREEDY = {"temperature": 0}        # sampling fields this SDK no longer names: sent as older clients send them
WEATHER = {"name": "get_weather", "description": "The weather in a city",   # finite: a random model's call ends
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(chat_llama_server):
    return chat_llama_server


@pytest.fixture(scope="module")
def tokenizer(server):
    return folder_tokenizer(server)                  # the server's own folder: with the chat template


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy(served_llama, tokenizer):
    """The Engine's greedy answer to SYSTEM + MESSAGES on transformers' rendering of the chat: (text, tokens, ids)."""
    text = tokenizer.apply_chat_template(OPENAI_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want, tokens = engine_greedy_text(served_llama[0], tokenizer, ids, MAX_TOKENS)
    assert len(tokens) >= 8, tokens            # a real continuation, not an immediate EOS
    return want, tokens, ids


def stop_reason(tokens, tokenizer) -> str:
    return "end_turn" if tokens[-1] == tokenizer.eos_token_id else "max_tokens"


def test_message_equals_engine_and_openai_chat(server, client, greedy, tokenizer):
    want, tokens, ids = greedy
    r = client.messages.create(model="llama", system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS,
                               extra_body=GREEDY, metadata={"user_id": "someone"})
    assert r.type == "message" and r.role == "assistant" and r.model == "llama" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason == stop_reason(tokens, tokenizer) and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), len(tokens))
    oai = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    answer = oai.chat.completions.create(model="llama", messages=OPENAI_MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert answer.choices[0].message.content == want
    # system as text blocks, content as text blocks: the same prompt
    r2 = client.messages.create(model="llama", system=[{"type": "text", "text": SYSTEM}], max_tokens=MAX_TOKENS,
                                messages=[{"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}],
                                extra_body=GREEDY)
    assert r2.content[0].text == want


def test_models_list(server, client):
    models = list(client.models.list())                   # GET /v1/models, as Anthropic's clients read it
    assert [(m.id, m.type, m.max_input_tokens) for m in models] == [("llama", "model", CHAT_MAX_LENGTH)]
    oai = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert [m.id for m in oai.models.list().data] == ["llama"]      # the OpenAI side's shape is unchanged


def test_stream_equals_engine(server, client, greedy, tokenizer):
    want, tokens, ids = greedy
    with client.messages.stream(model="llama", system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == want
    assert final.stop_reason == stop_reason(tokens, tokenizer)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(ids), len(tokens))
    # the raw event sequence, as Anthropic documents it
    body = {"model": "llama", "system": SYSTEM, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for n, d in zip(names, datas))
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert "".join(d["delta"]["text"] for d in datas[2:-3]) == want


def test_stop_sequence(client, greedy):
    want, _, _ = greedy
    stop = next(want[i:i + 3] for i in range(2, len(want) - 3) if want[i:i + 3].strip() == want[i:i + 3])
    r = client.messages.create(model="llama", system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS,
                               extra_body=GREEDY, stop_sequences=[stop, "never-appears-xyz"])
    assert r.content[0].text == want[:want.index(stop)]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(model="llama", system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                extra_body=GREEDY, stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == want[:want.index(stop)]
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_prefill_is_continued(client, served_llama, tokenizer):
    """A final assistant message is continued, as transformers' continue_final_message renders it."""
    history = [*OPENAI_MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    text = tokenizer.apply_chat_template(history, tokenize=False, continue_final_message=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want, _ = engine_greedy_text(served_llama[0], tokenizer, ids, 12)
    r = client.messages.create(model="llama", system=SYSTEM, max_tokens=12, extra_body=GREEDY,
                               messages=[*MESSAGES, {"role": "assistant", "content": "Sure, here"}])
    assert "".join(b.text for b in r.content) == want and r.usage.input_tokens == len(ids)
    assert client.messages.count_tokens(model="llama", system=SYSTEM, messages=[
        *MESSAGES, {"role": "assistant", "content": "Sure, here"}]).input_tokens == len(ids)


def test_count_tokens(client, greedy):
    _, _, ids = greedy
    r = client.messages.count_tokens(model="llama", system=SYSTEM, messages=MESSAGES)
    assert r.input_tokens == len(ids)


def test_bearer_and_wrong_key(server):
    body = {"model": "llama", "messages": MESSAGES, "max_tokens": 2}
    for headers in ({"Authorization": f"Bearer {API_KEY}"},                # either header with the key will do
                    {"Authorization": "Bearer wrong", "x-api-key": API_KEY}):
        assert httpx.post(server.base_url + "/messages", json=body, headers=headers, timeout=60).status_code == 200
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="llama", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.base_url + "/messages", json=body, timeout=60)          # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.base_url + "/chat/completions", headers={"x-api-key": API_KEY}, timeout=60,
                   json={"model": "llama", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200                                                     # x-api-key on the OpenAI side too


@pytest.mark.parametrize("body, status, words", [
    ({"model": "llama", "messages": MESSAGES}, 400, "max_tokens"),
    ({"model": "llama", "messages": MESSAGES, "max_tokens": "9"}, 400, "max_tokens"),
    ({"model": "llama", "messages": MESSAGES, "max_tokens": 4, "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"model": "llama", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "image"),
    ({"model": "llama", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "llama", "max_tokens": 4, "messages": []}, 400, "messages"),
    ({"model": "llama", "max_tokens": 100000, "messages": MESSAGES}, 400, "context length"),
    ({"model": "llama", "max_tokens": 4, "messages": MESSAGES, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"model": "llama", "max_tokens": 4, "messages": MESSAGES,
      "tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, 400, "tools.0.input_schema"),
    ({"model": "llama", "max_tokens": 4, "messages": MESSAGES,
      "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, 400, "other"),
    ({"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": MESSAGES}, 404, "claude-sonnet-4-5"),
])
def test_errors_in_anthropic_shape(server, body, status, words):
    r = httpx.post(server.base_url + "/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    want_type = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert r.json()["error"]["type"] == want_type and words in r.json()["error"]["message"], r.json()


def test_limits_in_anthropic_shape_and_metrics(server):
    def chunks():                                   # no Content-Length: refused once 16 MiB have arrived
        for _ in range(20):
            yield b"x" * 1_000_000
    r = server.post("/messages", content=chunks(), headers={"x-api-key": API_KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    text = "x y " * 500_000                         # far more than the max length holds: refused before tokenizing
    for path, extra in (("/messages", {"max_tokens": 4}), ("/messages/count_tokens", {})):
        r = server.post(path, {"model": "llama", "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": text}]}], **extra}, headers={"x-api-key": API_KEY})
        assert r.status_code == 400 and "before tokenizing" in r.json()["error"]["message"], r.text
    m = server.metrics()
    assert m['allspark_http_requests_total{endpoint="/v1/messages",status="413"}'] >= 1
    assert m['allspark_http_requests_total{endpoint="/v1/messages/count_tokens",status="400"}'] >= 1


def test_sdk_raises_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="llama", messages=MESSAGES, max_tokens=0)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="llama", messages=[{"role": "user", "content": 5}])


def forced_call(client, **kw):
    return client.messages.create(model="llama", messages=ASK, max_tokens=160, tools=[CLOCK, WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY, **kw)


def test_tool_use_round_trip(server, client):
    r = forced_call(client)
    assert r.stop_reason == "tool_use", repr(r.content[0].text)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # streamed: the same call, its input streamed as input_json_delta and put together by the SDK
    with client.messages.stream(model="llama", messages=ASK, max_tokens=160, tools=[CLOCK, WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds and final.stop_reason == "tool_use"
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [("get_weather", uses[0].input)]
    # `any`: some tool is called
    r_any = client.messages.create(model="llama", messages=ASK, max_tokens=160, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert r_any.stop_reason == "tool_use" and [b.name for b in r_any.content if b.type == "tool_use"] == [
        "get_weather"]
    # the result goes back as a tool_result block: the answer equals the OpenAI side's on the same conversation
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    answer = client.messages.create(model="llama", messages=history, max_tokens=16, tools=[CLOCK, WEATHER],
                                    extra_body=GREEDY)
    oai = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t["input_schema"]}} for t in (CLOCK, WEATHER)]
    call = {"id": uses[0].id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}
    want = oai.chat.completions.create(model="llama", max_tokens=16, temperature=0, tools=tools, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 21 C"}])
    msg = want.choices[0].message
    assert "".join(b.text for b in answer.content if b.type == "text") == (msg.content or "")
    assert [(b.name, b.input) for b in answer.content if b.type == "tool_use"] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert answer.usage.input_tokens == want.usage.prompt_tokens
    with client.messages.stream(model="llama", messages=history, max_tokens=16, tools=[CLOCK, WEATHER],
                                extra_body=GREEDY) as stream:                    # `auto`, streamed: the same answer
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"})
                                                                     for b in answer.content]
    assert final.stop_reason == answer.stop_reason
    counted = client.messages.count_tokens(model="llama", messages=history, tools=[CLOCK, WEATHER])
    assert counted.input_tokens == want.usage.prompt_tokens


def test_disable_parallel_tool_use_and_none(client):
    r = forced_call(client)
    r_none = client.messages.create(model="llama", messages=ASK, max_tokens=8, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert all(b.type == "text" for b in r_none.content) and r_none.stop_reason != "tool_use"
    single = client.messages.create(model="llama", messages=ASK, max_tokens=160, tools=[CLOCK, WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather",
                                                 "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert [(b.name, b.input) for b in single.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in r.content if b.type == "tool_use"]
