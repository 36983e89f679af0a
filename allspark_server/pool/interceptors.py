"""The pool's gRPC interceptors: GuardCalls (a request that does not parse ends INVALID_ARGUMENT; a pool that is
stopping or going down answers UNAVAILABLE) and DropStalledStreams (a stream whose client stopped reading is
dropped after a time limit, which releases its request)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Optional

import grpc

log = logging.getLogger(__name__)

STREAM_STALL_S = 30.0        # default: a stream whose client has not taken a reply for this long is dropped


class _Malformed:
    """What a request's bytes became when they do not parse (GuardCalls)."""
    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


class GuardCalls(grpc.aio.ServerInterceptor):
    """Two refusals before a method runs. A request whose bytes do not parse as its message type ends
    INVALID_ARGUMENT saying so (grpc.aio itself answers UNKNOWN, the code of an exception a servicer let out):
    the deserializer never raises, it hands the method a _Malformed, which the wrapped method turns into the
    status. A pool that is stopping or going down (`down()` gives the reason: SIGTERM, a hung step) answers
    UNAVAILABLE, which clients raise as PoolUnavailable."""

    def __init__(self, down: Callable[[], Optional[str]] = lambda: None):
        self.down = down

    async def _refuse(self, request, context) -> None:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        reason = self.down()
        if reason is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def safe_parse(data):
            try:
                return parse(data)
            except Exception as e:
                return _Malformed(f"{method}: the request does not parse as its message type ({e})")

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                await self._refuse(request, context)
                async with contextlib.aclosing(inner_stream(request, context)) as replies:
                    async for reply in replies:
                        yield reply
            return grpc.unary_stream_rpc_method_handler(stream, safe_parse, handler.response_serializer)
        inner = handler.unary_unary

        async def unary(request, context):
            await self._refuse(request, context)
            reply = await inner(request, context)
            if getattr(reply, "status", 0) != 0 and self.down() is not None:
                # the pool began stopping while this call ran (the engine refused it as shut down): the same
                # UNAVAILABLE a call arriving a moment later gets
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.down())
            return reply
        return grpc.unary_unary_rpc_method_handler(unary, safe_parse, handler.response_serializer)


async def write_within(context, reply, seconds: float) -> None:
    """context.write(reply), or TimeoutError after `seconds` (asyncio.timeout: a timer handle per reply where
    wait_for would make a task; Python 3.10 has only wait_for)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            await context.write(reply)
    else:
        await asyncio.wait_for(context.write(reply), seconds)


class DropStalledStreams(grpc.aio.ServerInterceptor):
    """Bounds what a client that stops reading its stream can hold. A stream's replies are written with a time
    limit: HTTP/2 flow control makes a write wait while the client does not read, and a write still waiting
    after `stall_s` seconds ends the stream RESOURCE_EXHAUSTED, which releases its request (its batch slot, its
    KV spans, its undelivered tokens). Until then what waits is bounded too: one reply in the write and the
    request's own tokens (at most max_new_tokens) in its ResultQueue."""

    def __init__(self, stall_s: float = STREAM_STALL_S):
        if stall_s <= 0:
            raise ValueError(f"stream stall timeout must be > 0 seconds, got {stall_s}")
        self.stall_s = stall_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming or handler.request_streaming:
            return handler
        replies_of, method, stall_s = handler.unary_stream, handler_call_details.method, self.stall_s

        async def write_each(request, context):
            async with contextlib.aclosing(replies_of(request, context)) as replies:   # released on the way out
                async for reply in replies:
                    try:
                        await write_within(context, reply, stall_s)
                    except (asyncio.TimeoutError, TimeoutError):
                        log.warning("%s: the client has not read its stream for %.0f s: dropping it", method, stall_s)
                        await replies.aclose()     # the request is released first: abort may wait on the client
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"the client did not read its stream for {stall_s:g} s (allspark-launch "
                                            f"--stream-stall-timeout): the pool dropped it and released its request")
        return grpc.unary_stream_rpc_method_handler(write_each, handler.request_deserializer,
                                                    handler.response_serializer)
