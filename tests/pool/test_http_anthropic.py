"""The Anthropic Messages API of allspark-serve (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client: non-streamed and streamed answers equal the in-process Engine's greedy output on the prompt
transformers' chat template renders (and the server's OpenAI chat answer), the SSE event sequence parses in the SDK
with warnings as errors, stop sequences, token counts, a forced tool_use round trip, Anthropic-shaped errors and the
`x-api-key` header. One server for the module (API key set, chat template added)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from http_helpers import API_KEY, Server, engine_greedy_text, with_chat_template

pytestmark = pytest.mark.filterwarnings("error")
SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Hello world!"}]
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
MAX_TOKENS = 20
GREEDY = {"temperature": 0}        # sampling fields this SDK no longer names: sent as older clients send them
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer", "minimum": 1}},
                            "required": ["city", "days"]}}


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    hf_dir = with_chat_template(llama.hf_dir, str(tmp_path_factory.mktemp("chat") / "llama"))
    srv = Server(hf_dir, "--max-length", "512", "--max-batch", "4", api_key=API_KEY)
    srv.model_dir = hf_dir
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(server.model_dir)


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


def test_count_tokens(client, greedy):
    _, _, ids = greedy
    r = client.messages.count_tokens(model="llama", system=SYSTEM, messages=MESSAGES)
    assert r.input_tokens == len(ids)


def test_bearer_and_wrong_key(server):
    body = {"model": "llama", "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(server.base_url + "/messages", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60).status_code == 200
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


def test_sdk_raises_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="llama", messages=MESSAGES, max_tokens=0)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="llama", messages=[{"role": "user", "content": 5}])
