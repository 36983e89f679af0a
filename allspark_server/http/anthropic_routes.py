"""The Anthropic Messages API's routes: POST /v1/messages (one message, or its events streamed) and
POST /v1/messages/count_tokens, served by the OpenAI routes' flow (serving.py: chat template, admission, limits,
detokenizing, stop strings, release when the client goes away) with Anthropic's bodies.

Validation is anthropic_request.py, bodies and events anthropic_events.py; tool calls are the tools package's
(its parsers read the output, its grammars force `any` and a named tool). Errors raised here are ApiErrors, which
the app answers in Anthropic's shape on these paths (anthropic_request.error_body).
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
from allspark_server.http.protocol import ApiError
from allspark_server.http.serving import Serving, SSEResponse

log = logging.getLogger("allspark.http")


def add_messages_routes(app, serving: Serving, parse) -> None:
    """The two routes on `app`; `parse(parse_request, request)` reads and validates a body (app.py's)."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await create_message(serving, request, await parse(parse_messages, request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        m = await parse(parse_count_tokens, request)
        return {"input_tokens": len(await serving.prompt_ids(prepare(serving, m)))}


def prepare(serving: Serving, m: MessagesRequest):
    """The ApiRequest to serve: with tools, what the template receives and the grammar that forces a call."""
    return m.api


def _stop_reason(run, tool_calls: bool) -> tuple[str, Optional[str]]:
    if tool_calls:
        return "tool_use", None
    if run.stops.matched:
        return "stop_sequence", run.stops.matched_stop
    return ("max_tokens" if run.finish_reason == "length" else "end_turn"), None


async def create_message(serving: Serving, request: Request, m: MessagesRequest) -> Response:
    req = prepare(serving, m)
    run = await serving.start(req)
    msg_id = new_message_id()
    if req.stream:
        return SSEResponse(_events(run, m, msg_id), on_close=run.close)
    text, _ = await run.collect(request)
    if run.finish_reason == "abort":
        return Response(status_code=499)       # nobody is listening
    content = [{"type": "text", "text": text}] if text else []
    stop_reason, stop_sequence = _stop_reason(run, False)
    return JSONResponse(message(msg_id, req.model, content, stop_reason, stop_sequence, run.prompt_tokens,
                                run.n_tokens))


async def _events(run, m: MessagesRequest, msg_id: str) -> AsyncIterator[bytes]:
    es = EventStream(msg_id, m.api.model)
    try:
        yield es.start(run.prompt_tokens)
        try:
            async for piece in run.pieces():
                if piece.text:
                    yield es.text(piece.text)
        except Exception as e:          # headers are sent: the error can only travel as an event
            log.exception("generation stream failed")
            run.error = ApiError(500, f"internal error: {e!r}")
        if run.error is not None:
            yield es.error(error_body(run.error))
        elif run.finish_reason != "abort":
            stop_reason, stop_sequence = _stop_reason(run, False)
            yield es.finish(stop_reason, stop_sequence, run.n_tokens)
    finally:
        run.close()


__all__ = ["add_messages_routes", "create_message", "new_tool_use_id", "tool_use_block"]
