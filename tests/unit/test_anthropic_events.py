"""anthropic_events.py and the route's stream, read by the official `anthropic` SDK: a text block then a tool_use
block accumulate into the message the SDK builds (its own accumulate_event and partial-JSON reader), and a
generation that fails mid-stream ends with an `error` event that the SDK's Stream raises as an APIStatusError."""
from __future__ import annotations

import asyncio
import json
import warnings

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from allspark_server.http.anthropic_events import EventStream
from allspark_server.http.anthropic_request import parse_messages
from allspark_server.http.anthropic_routes import _events
from allspark_server.http.serving import Piece


def sdk_events(raw: bytes) -> list:
    """The events as the SDK's Stream yields them (raising on an `error` event)."""
    client = anthropic.Anthropic(api_key="k", base_url="http://localhost")
    response = httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"},
                              request=httpx.Request("POST", "http://localhost/v1/messages"))
    return list(anthropic.Stream(cast_to=RawMessageStreamEvent, response=response, client=client))


def test_text_then_tool_use_accumulates_in_the_sdk():
    es = EventStream("msg_1", "m")
    raw = (es.start(5) + es.text("Hi ") + es.text("") + es.text("there") + es.tool_start("toolu_1", "f")
           + es.tool_args('{"a": [1, ') + es.tool_args('"x"]}') + es.finish("tool_use", None, 7))
    for chunk in raw.decode().split("\n\n")[:-1]:             # each event's name is its data's type
        name, data = chunk.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snapshot, bufs = None, {}
        events = sdk_events(raw)
        for e in events:
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_delta", "content_block_stop", "content_block_start",
                                        "content_block_delta", "content_block_delta", "content_block_stop",
                                        "message_delta", "message_stop"]
    assert snapshot.id == "msg_1" and snapshot.model == "m" and snapshot.role == "assistant"
    text, tool = snapshot.content
    assert text.type == "text" and text.text == "Hi there"
    assert (tool.type, tool.id, tool.name, tool.input) == ("tool_use", "toolu_1", "f", {"a": [1, "x"]})
    assert (snapshot.stop_reason, snapshot.stop_sequence) == ("tool_use", None)
    assert (snapshot.usage.input_tokens, snapshot.usage.output_tokens) == (5, 7)


class _FailingRun:
    """A started request whose generation breaks after its first piece."""
    prompt_tokens, n_tokens, error, finish_reason = 3, 1, None, None
    closed = False

    async def pieces(self):
        yield Piece("Hel")
        raise RuntimeError("the engine broke")

    def close(self):
        self.closed = True


def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises():
    m = parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "m")
    run = _FailingRun()

    async def collect():
        return b"".join([b async for b in _events(run, m, "msg_2", None)])

    raw = asyncio.run(collect())
    assert run.closed and raw.decode().split("\n\n")[-2].startswith("event: error\n")
    with pytest.raises(anthropic.APIStatusError) as e:
        sdk_events(raw)
    assert e.value.body["error"]["type"] == "api_error" and "the engine broke" in e.value.body["error"]["message"]
