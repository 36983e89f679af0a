"""anthropic_request.py on hand-worked bodies: content blocks become the chat template's messages (system,
tool_use -> tool_calls, tool_result -> tool messages), tool_choice maps onto OpenAI's modes, bad bodies are 400s
naming the field, and error bodies take Anthropic's documented shape."""
from __future__ import annotations

import json

import pytest

from allspark_server.http.anthropic_request import error_body, parse_count_tokens, parse_messages
from allspark_server.http.protocol import ApiError

WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(**body):
    return parse_messages({"model": "m", "max_tokens": 8, **body}, "m")


def test_system_and_text_blocks():
    m = parse(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {}}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "z"}],
              stop_sequences=["END"], temperature=0.5, top_k=3, metadata={"user_id": "u"})
    assert m.api.kind == "chat" and m.api.max_tokens == 8 and m.api.stop == ("END",)
    assert m.api.sampling == {"temperature": 0.5, "top_k": 3}
    assert m.api.messages == [{"role": "system", "content": "A\nB"}, {"role": "user", "content": "x\ny"},
                              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "z"}]
    assert m.tools == [] and m.tool_choice is None


def test_tool_use_and_tool_result_blocks():
    m = parse(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                     {"type": "text", "text": "Thanks"}]}])
    user, assistant, tool1, tool2, last = m.api.messages
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant["role"] == "assistant" and assistant["content"] == "Let me check."
    [call] = assistant["tool_calls"]
    assert (call["id"], call["type"], call["function"]["name"]) == ("toolu_1", "function", "get_weather")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert tool1 == {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny", "name": "get_weather"}
    assert tool2 == {"role": "tool", "tool_call_id": "toolu_9", "content": "a\nb"}     # no call of that id seen
    assert last == {"role": "user", "content": "Thanks"}
    assert [s.name for s in m.tools] == ["get_weather"] and m.tools[0].parameters == WEATHER["input_schema"]
    assert m.tool_choice.mode == "auto"


@pytest.mark.parametrize("choice, mode, name", [({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None),
                                                ({"type": "tool", "name": "get_weather"}, "named", "get_weather"),
                                                ({"type": "none"}, "none", None)])
def test_tool_choice(choice, mode, name):
    m = parse(tools=[WEATHER], tool_choice=choice, messages=[{"role": "user", "content": "x"}])
    assert (m.tool_choice.mode, m.tool_choice.name) == (mode, name)


@pytest.mark.parametrize("body, status, where", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: Field required"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400,
     "n: Extra inputs"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {}}]}]}, 400, "messages.0.content.1: image"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 400, "messages.0.content.0"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": "y "}]}, 400, "prefill"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [WEATHER, WEATHER]}, 400, "tools.1.name"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
    ({"model": "other", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}, 404, "model: "),
])
def test_bad_bodies(body, status, where):
    with pytest.raises(ApiError) as e:
        parse_messages(body, "m")
    message = error_body(e.value)["error"]["message"]
    assert e.value.status == status and where in message, message


def test_a_final_assistant_message_is_continued():
    m = parse(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "text", "text": "The answer"}]}])
    assert m.api.continue_final and m.api.messages[-1] == {"role": "assistant", "content": "The answer"}
    assert not parse(messages=[{"role": "user", "content": "x"}]).api.continue_final


def test_continued_cuts_after_the_final_text():
    from allspark_server.http.chat_template import TemplateFailed, continued
    rendered = "<|user|>The answer\n<|assistant|>The answer\n"      # hand-rendered; the text occurs twice
    assert continued(rendered, "The answer") == "<|user|>The answer\n<|assistant|>The answer"
    with pytest.raises(TemplateFailed):
        continued(rendered, "Something else")


def test_count_tokens_needs_no_max_tokens():
    m = parse_count_tokens({"model": "m", "system": "s", "messages": [{"role": "user", "content": "x"}]}, "m")
    assert m.api.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    with pytest.raises(ApiError, match="max_tokens: Extra inputs"):
        parse_count_tokens({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, "m")


def test_output_config_format_is_guided_json():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    m = parse(messages=[{"role": "user", "content": "x"}],
              output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert m.api.sampling["response_format"] == {"type": "json_schema",
                                                 "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")])
def test_error_body_shape(status, kind):
    assert error_body(ApiError(status, "why")) == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert error_body(ApiError(status, "why", param="top_k"))["error"]["message"] == "top_k: why"
