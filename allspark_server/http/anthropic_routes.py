"""The Anthropic Messages API's routes: POST /v1/messages (one message, or its events streamed) and
POST /v1/messages/count_tokens, served by the OpenAI routes' flow (serving.py: chat template, admission, limits,
detokenizing, stop strings, release when the client goes away) with Anthropic's bodies.

Validation is anthropic_request.py, bodies and events anthropic_events.py; tool calls are the tools package's
(serving.py gives the tools to the chat template and forces `any` / a named tool with their grammar; its parsers
read the output here). Errors raised here are ApiErrors, which the app answers in Anthropic's shape on these paths.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from allspark_server.http.anthropic_events import (
    EventStream,
    message,
    new_message_id,
    new_tool_use_id,
    tool_use_block,
)
from allspark_server.http.anthropic_request import MessagesRequest, error_body, parse_count_tokens, parse_messages
from allspark_server.http.protocol import ApiError, ApiRequest, bad_request
from allspark_server.http.serving import Serving, SSEResponse
from allspark_server.http.tools import TextDelta, ToolArgsDelta, ToolCallStart
from allspark_server.http.tools.chat import tools_active

log = logging.getLogger("allspark.http")


def add_messages_routes(app, serving: Serving, parse) -> None:
    """The two routes on `app`; `parse(parse_request, request)` reads and validates a body (app.py's)."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await create_message(serving, request, await parse(parse_messages, request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        m = await parse(parse_count_tokens, request)
        return {"input_tokens": len(await serving.prompt_ids(prepare(m)))}


def prepare(m: MessagesRequest) -> ApiRequest:
    """The ApiRequest to serve, its tools set: serving.py gives them to the chat template and, for tool_choice `any`
    or a named tool, runs the output under the grammar that forces a call (tools/chat.py)."""
    req = m.api
    req.tools, req.tool_choice = m.tools, m.tool_choice
    forced = m.tool_choice is not None and m.tool_choice.mode in ("required", "named")
    if forced and "response_format" in req.sampling:
        raise bad_request("tool_choice: `any` or a named tool cannot be combined with output_config.format (both "
                          "constrain the output)", param="tool_choice")
    return req


def _parser(serving: Serving, m: MessagesRequest):
    """The tool-call parser that reads this request's output; None when it has no tools to call."""
    return serving.tools.parser(m.tools) if tools_active(m.tools, m.tool_choice) else None


def _content(serving: Serving, m: MessagesRequest, text: str) -> list[dict]:
    """A whole output's content blocks: its text, then a tool_use block per call."""
    parser = _parser(serving, m)
    if parser is None:
        return [{"type": "text", "text": text}] if text else []
    content, calls = parser.parse(text)
    calls = calls[:1] if m.disable_parallel_tool_use else calls
    return ([{"type": "text", "text": content}] if content else []) + [
        tool_use_block(new_tool_use_id(), c.name, c.arguments) for c in calls]


def _stop_reason(run, tool_calls: bool) -> tuple[str, Optional[str]]:
    if tool_calls and run.finish_reason == "stop":
        return "tool_use", None
    if run.stops.matched:
        return "stop_sequence", run.stops.matched_stop
    return ("max_tokens" if run.finish_reason == "length" else "end_turn"), None


async def create_message(serving: Serving, request: Request, m: MessagesRequest) -> Response:
    req = prepare(m)
    run = await serving.start(req)
    msg_id = new_message_id()
    if req.stream:
        return SSEResponse(_events(run, m, msg_id, _parser(serving, m)), on_close=run.close)
    text, _ = await run.collect(request)
    if run.finish_reason == "abort":
        return Response(status_code=499)       # nobody is listening
    content = _content(serving, m, text)
    stop_reason, stop_sequence = _stop_reason(run, any(b["type"] == "tool_use" for b in content))
    return JSONResponse(message(msg_id, req.model, content, stop_reason, stop_sequence, run.prompt_tokens,
                                run.n_tokens))


class _ToolEvents:
    """The events of a streamed output read by a tool-call parser: text, then a tool_use block per call whose
    input's JSON text streams as `input_json_delta`s."""

    def __init__(self, es: EventStream, parser, single: bool):
        self.es, self.stream, self.single = es, parser.stream(), single
        self.calls = 0

    def feed(self, text: str) -> bytes:
        return self._bytes(self.stream.feed(text)) if text else b""

    def finish(self) -> bytes:
        return self._bytes(self.stream.finish())

    def _bytes(self, events) -> bytes:
        out = []
        for e in events:
            if isinstance(e, TextDelta):
                out.append(self.es.text(e.text))
            elif self.single and e.index > 0:        # disable_parallel_tool_use: the first call only
                continue
            elif isinstance(e, ToolCallStart):
                self.calls += 1
                out.append(self.es.tool_start(new_tool_use_id(), e.name))
            elif isinstance(e, ToolArgsDelta):
                out.append(self.es.tool_args(e.arguments))
        return b"".join(out)


async def _events(run, m: MessagesRequest, msg_id: str, parser) -> AsyncIterator[bytes]:
    es = EventStream(msg_id, m.api.model)
    tools = _ToolEvents(es, parser, m.disable_parallel_tool_use) if parser is not None else None
    try:
        yield es.start(run.prompt_tokens)
        try:
            async for piece in run.pieces():
                out = tools.feed(piece.text) if tools is not None else es.text(piece.text)
                if out:
                    yield out
            out = tools.finish() if tools is not None and run.error is None else b""
            if out:
                yield out
        except Exception as e:          # headers are sent: the error can only travel as an event
            log.exception("generation stream failed")
            run.error = ApiError(500, f"internal error: {e!r}")
        if run.error is not None:
            yield es.error(error_body(run.error))
        elif run.finish_reason != "abort":
            stop_reason, stop_sequence = _stop_reason(run, tools is not None and tools.calls > 0)
            yield es.finish(stop_reason, stop_sequence, run.n_tokens)
    finally:
        run.close()
