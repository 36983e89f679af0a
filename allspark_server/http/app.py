"""The FastAPI app: routes (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics), Bearer auth
on /v1/*, HTTP status counting, and OpenAI error bodies for every error (400, 401, 404, 413, 429, 500, 503).

A thin layer: bodies are read by body.py, validated by protocol.py and served by serving.py; the engine is reached
only through backend.py's executor. The middleware is plain ASGI (not BaseHTTPMiddleware) so streams pass through
untouched; it also answers unhandled errors with a 500 that keeps the connection.
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
from starlette.responses import JSONResponse, Response

from allspark_client import settings
from allspark_server.http.admission import Admission
from allspark_server.http.body import read_json
from allspark_server.http.chat_template import RENDER_TIMEOUT_S
from allspark_server.http.metrics import Metrics
from allspark_server.http.protocol import ApiError, parse_chat, parse_completion
from allspark_server.http.serving import Serving
from allspark_server.http.stream import QueueReader

log = logging.getLogger("allspark.http")
ENGINE_CALL_TIMEOUT_S = 5.0    # /health and /metrics give up on the engine after this long


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ServerMiddleware:
    """Bearer auth for /v1/* (when an API key is set) and a count of responses by endpoint and status."""

    def __init__(self, app, api_key: Optional[str], metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

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

        if self.expected is not None and path.startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                msg = "Incorrect API key provided." if given else "Missing API key: send 'Authorization: Bearer KEY'."
                err = ApiError(401, msg, code="invalid_api_key")
                return await error_response(err)(scope, receive, counting_send)
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            # answered here, not by Starlette's outermost handler: that one re-raises, and uvicorn then drops the
            # client's keep-alive connection
            if started:
                raise
            log.exception("unhandled error")
            await error_response(ApiError(500, f"internal error: {exc!r}"))(scope, receive, counting_send)


def create_app(backend, *, api_key: Optional[str] = None, max_concurrent: int = 256, max_queue: int = 256,
               max_body_bytes: int = int(settings.MAX_BODY_MB.default * 2**20),
               chat_template_timeout_s: float = RENDER_TIMEOUT_S) -> FastAPI:
    """The ASGI app serving `backend` (a started backend.Backend). Closing the backend is the caller's job."""
    admission = Admission(max_concurrent, max_queue)
    reader = QueueReader()
    metrics = Metrics(backend.name, admission)
    serving = Serving(backend, admission, reader, metrics, chat_template_timeout_s)
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
    async def _api_error(_request, err: ApiError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                       else None))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.handle(request, parse_chat(await read_json(request, max_body_bytes), backend.name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.handle(request, parse_completion(await read_json(request, max_body_bytes),
                                                              backend.name))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": started,
                                            "owned_by": "allspark", "max_model_len": backend.engine_max_length}]}

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
