"""POST /v1/embeddings: OpenAI's request and response shapes over the engine's `embed` (Engine or ClientEngine).

`input` is a string, an array of strings, an array of token ids or an array of such arrays; each input is one
vector: the decoder's final-norm hidden states pooled as the server was started (`--embedding-pooling last|mean`)
and L2-normalized (unit length, as OpenAI's embeddings are). `encoding_format` "float" (lists of numbers) or
"base64" (the float32 little-endian bytes, what the `openai` client asks for by default); `dimensions` is accepted
only equal to the model's hidden size (no truncation). Owns parsing and the response body; the engine owns the math.
"""
from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from allspark_client.client import PoolUnavailable
from allspark_client.embed_args import MAX_EMBED_INPUTS, POOLINGS
from allspark_client.types import AsException, AsStatus
from allspark_server.http.body import read_json
from allspark_server.http.protocol import ApiError, bad_request, model_not_found

DEFAULT_POOLING = "last"      # a decoder's last token has seen the whole input
EMBED_THREADS = 4             # embeddings calls waiting on the engine at once (beside the backend's control calls)
FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


@dataclass
class EmbeddingsRequest:
    model: str
    inputs: list                      # each a str or a list of token ids
    encoding_format: str = "float"
    dimensions: int = 0               # 0: not given


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_embeddings(body: Any, served_model: str) -> EmbeddingsRequest:
    """The body validated; 400s name the bad field, 404 an unknown model."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}", param=unknown[0])
    if not isinstance(body.get("model"), str):
        raise bad_request("you must provide a model parameter", param="model")
    if body["model"] != served_model:
        raise model_not_found(body["model"], served_model)
    raw = body.get("input")
    if isinstance(raw, str) or _is_ids(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or _is_ids(x) for x in raw):
        inputs = list(raw)
    else:
        raise bad_request("'input' must be a string, an array of strings, an array of token ids or an array of "
                          "token-id arrays, none of them empty", param="input")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise bad_request(f"'input' holds {len(inputs)} inputs, more than {MAX_EMBED_INPUTS}", param="input")
    if any(x == "" for x in inputs):
        raise bad_request("'input' cannot contain an empty string", param="input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r:.40}", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise bad_request(f"'dimensions' must be a positive integer, got {dims!r:.40}", param="dimensions")
    return EmbeddingsRequest(body["model"], inputs, fmt, dims or 0)


def embeddings_body(req: EmbeddingsRequest, vectors: list, prompt_tokens: int) -> dict:
    def encode(v):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" \
            else v.tolist()
    return {"object": "list", "model": req.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def add_embeddings_route(app: FastAPI, backend, max_body_bytes: int, pooling: str = DEFAULT_POOLING) -> None:
    """POST /v1/embeddings on `app`, pooling the hidden states as `pooling` says (POOLINGS)."""
    if pooling not in POOLINGS:
        raise ValueError(f"embedding pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    hidden_size = None
    # its own threads: a long embed must not hold the threads that start and release generation requests
    executor = ThreadPoolExecutor(EMBED_THREADS, thread_name_prefix="allspark-http-embed")

    def run(req: EmbeddingsRequest):
        nonlocal hidden_size
        tok = backend.tokenizer
        ids = [tok(x)["input_ids"] if isinstance(x, str) else x for x in req.inputs]
        for i, x in enumerate(ids):
            if len(x) > backend.engine_max_length:
                raise bad_request(f"This model's maximum context length is {backend.engine_max_length} tokens. "
                                  f"However, input[{i}] has {len(x)} tokens. Please reduce its length.",
                                  param="input", code="context_length_exceeded")
        try:
            vectors = backend.engine.embed(backend.name, ids, pooling=pooling, normalize=True)
        except PoolUnavailable as e:
            raise ApiError(503, e.message, code="unavailable") from None
        except AsException as e:
            if e.status in (AsStatus.ALLSPARK_PARAM_ERROR, AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR):
                raise bad_request(e.message.replace("input_ids_list", "input"), param="input") from None
            if e.status == AsStatus.ALLSPARK_REQUEST_DENIED:
                raise ApiError(503, f"the model is not serving: {e.message}", code="unavailable") from None
            raise ApiError(500, f"{e.status.name}: {e.message}") from None
        hidden_size = len(vectors[0])
        return vectors, sum(map(len, ids))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = parse_embeddings(await read_json(request, max_body_bytes), backend.name)
        if req.dimensions and hidden_size is not None and req.dimensions != hidden_size:
            raise _dimensions_error(req.dimensions, hidden_size)
        vectors, n = await asyncio.get_running_loop().run_in_executor(executor, run, req)
        if req.dimensions and req.dimensions != len(vectors[0]):
            raise _dimensions_error(req.dimensions, len(vectors[0]))
        return embeddings_body(req, vectors, n)


def _dimensions_error(asked: int, size: int) -> ApiError:
    return bad_request(f"'dimensions' {asked} is not supported: this model's embeddings have {size} dimensions "
                       f"(no truncation)", param="dimensions")
