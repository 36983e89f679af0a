"""The FastAPI app: routes (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /v1/load_lora_adapter,
/v1/unload_lora_adapter, /health, /metrics; /tokenize and /detokenize: tokenize_routes.py), Bearer auth on /v1/*
and the tokenize routes, HTTP status counting, and OpenAI error bodies
for every error (400, 401, 404, 409, 413, 429, 500, 503).

A thin layer: bodies are read by body.py, validated by protocol.py (lora.py: the adapters' endpoints) and served by
serving.py; the engine is reached only through backend.py's executor. The middleware is plain ASGI (not
BaseHTTPMiddleware) so streams pass through untouched; it also answers unhandled errors with a 500 that keeps the
connection.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from allspark_client import settings
from allspark_client.client import PoolUnavailable
from allspark_client.types import AsStatus
from allspark_server.http.admission import Admission
from allspark_server.http.anthropic_events import model_list as anthropic_model_list
from allspark_server.http.anthropic_request import error_body as anthropic_error_body
from allspark_server.http.anthropic_request import is_anthropic_path
from allspark_server.http.anthropic_routes import add_messages_routes
from allspark_server.http.body import read_json
from allspark_server.http.chat_template import RENDER_TIMEOUT_S
from allspark_server.http.embeddings import DEFAULT_POOLING, add_embeddings_route
from allspark_server.http.lora_requests import loaded_message, lora_error, parse_load, parse_unload, unloaded_message
from allspark_server.http.metrics import Metrics
from allspark_server.http.protocol import ApiError, parse_chat, parse_completion
from allspark_server.http.serving import Serving
from allspark_server.http.stream import QueueReader
from allspark_server.http.tokenize_routes import PATHS as TOKENIZE_PATHS
from allspark_server.http.tokenize_routes import add_tokenize_routes

log = logging.getLogger("allspark.http")
ENGINE_CALL_TIMEOUT_S = 5.0    # /health and /metrics give up on the engine after this long


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """The error's body: Anthropic's shape on the Messages API's paths, OpenAI's elsewhere."""
    body = anthropic_error_body(err) if is_anthropic_path(path) else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class ServerMiddleware:
    """Bearer auth for /v1/* (when an API key is set) and a count of responses by endpoint and status."""

    def __init__(self, app, api_key: Optional[str], metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.expected_key = api_key.encode() if api_key else None      # Anthropic's clients: `x-api-key: KEY`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = self.metrics.endpoint_label(path)

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.expected is not None and (path.startswith("/v1") or path in TOKENIZE_PATHS):
            headers = dict(scope["headers"])
            given, given_key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
            ok = hmac.compare_digest(given, self.expected) | (    # either header with the key will do
                given_key is not None and hmac.compare_digest(given_key, self.expected_key))
            if not ok:
                msg = ("Incorrect API key provided." if given or given_key is not None
                       else "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
                err = ApiError(401, msg, code="invalid_api_key")
                return await error_response(err, path)(scope, receive, counting_send)
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            # answered here, not by Starlette's outermost handler: that one re-raises, and uvicorn then drops the
            # client's keep-alive connection
            if started:
                raise
            log.exception("unhandled error")
            await error_response(ApiError(500, f"internal error: {exc!r}"), path)(scope, receive, counting_send)


def create_app(backend, *, api_key: Optional[str] = None, max_concurrent: int = 256, max_queue: int = 256,
               max_body_bytes: int = int(settings.MAX_BODY_MB.default * 2**20),
               chat_template_timeout_s: float = RENDER_TIMEOUT_S, tool_call_parser: Optional[str] = None,
               embedding_pooling: str = DEFAULT_POOLING) -> FastAPI:
    """The ASGI app serving `backend` (a started backend.Backend). Closing the backend is the caller's job."""
    admission = Admission(max_concurrent, max_queue)
    reader = QueueReader()
    metrics = Metrics(backend.name, admission)
    serving = Serving(backend, admission, reader, metrics, chat_template_timeout_s, tool_call_parser)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        serving.warm()                  # a chat template renderer, started ahead of the first chat request
        try:
            yield
        finally:
            serving.close()
            await reader.close()

    app = FastAPI(title="allspark", summary="OpenAI-compatible API of an allspark Engine or pool",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.backend, app.state.metrics, app.state.admission = backend, metrics, admission
    app.add_middleware(ServerMiddleware, api_key=api_key, metrics=metrics)

    async def engine_call(fn):
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(backend.executor, fn), ENGINE_CALL_TIMEOUT_S)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return error_response(err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                       else None), request.url.path)

    async def refresh_loras():
        """The engine's adapters read again (another client of a shared pool may have loaded one): the new
        `backend.loras`, or the last one seen when the engine cannot answer."""
        try:
            return await engine_call(backend.refresh_loras)
        except Exception:
            return backend.loras

    async def parse(parse_request, request: Request):
        """The body validated; `model` is the served model or a loaded LoRA adapter (looked up again before a 404)."""
        body = await read_json(request, max_body_bytes)
        try:
            return parse_request(body, backend.name, backend.loras)
        except ApiError as e:
            if e.code != "model_not_found":
                raise
        return parse_request(body, backend.name, await refresh_loras())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.handle(request, await parse(parse_chat, request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.handle(request, await parse(parse_completion, request))

    add_messages_routes(app, serving, parse)       # /v1/messages, /v1/messages/count_tokens
    add_embeddings_route(app, backend, max_body_bytes, embedding_pooling)   # /v1/embeddings
    add_tokenize_routes(app, serving, parse)       # /tokenize, /detokenize

    @app.get("/v1/models")
    async def models(request: Request):
        entry = {"object": "model", "created": started, "owned_by": "allspark",
                 "max_model_len": backend.engine_max_length}
        loras = await refresh_loras()
        if "anthropic-version" in request.headers:      # Anthropic's clients send it: their list's shape
            return anthropic_model_list([backend.name, *sorted(loras)], started, backend.engine_max_length)
        return {"object": "list", "data": [{"id": backend.name, **entry}] + [
            {"id": name, **entry, "root": path, "parent": backend.name} for name, path in sorted(loras.items())]}

    async def lora_call(fn, *args):
        """A load / unload on the engine executor (no time limit: loading reads the adapter on every rank)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(backend.executor, fn, *args)
        except PoolUnavailable as e:
            raise ApiError(503, e.message, code="unavailable") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        name, path = parse_load(await read_json(request, max_body_bytes), backend.name)
        status, error = await lora_call(backend.load_lora, name, path)
        if status != AsStatus.ALLSPARK_SUCCESS:
            raise lora_error(status, error, name, loading=True)
        return PlainTextResponse(loaded_message(name))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = parse_unload(await read_json(request, max_body_bytes), backend.name)
        status, error = await lora_call(backend.unload_lora, name)
        if status != AsStatus.ALLSPARK_SUCCESS:
            raise lora_error(status, error, name, loading=False)
        return PlainTextResponse(unloaded_message(name))

    async def engine_state(fn, unavailable):
        """fn() on the engine executor; `unavailable` when the engine or pool cannot answer."""
        try:
            return await engine_call(fn)
        except Exception:
            return unavailable

    @app.get("/health")
    async def health():
        return Response(status_code=200 if await engine_state(backend.is_ready, False) else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(await engine_state(backend.stat, None)), media_type=CONTENT_TYPE_LATEST)

    return app
