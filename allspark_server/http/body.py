"""A request's JSON body, read defensively: at most `max_bytes` (413 past that: a Content-Length over it is refused
before anything is read, a chunked body as soon as it passes it), parsed, and refused with a 400 naming the place
when it nests deeper than MAX_DEPTH or holds a lone UTF-16 surrogate ("\\ud800" alone is valid JSON but no Unicode
text: the tokenizer, and any JSON body that would echo it, fail on it).

Knows nothing of the endpoints' fields (protocol.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from allspark_server.http.protocol import ApiError, bad_request

MAX_DEPTH = 64           # nested arrays / objects; OpenAI bodies (JSON schemas included) stay far below
_SURROGATE = re.compile("[\ud800-\udfff]")     # left in a str by json.loads only when unpaired


def too_large(max_bytes: int) -> ApiError:
    # the rest of the body is not read: the connection cannot carry another request
    return ApiError(413, f"the request body is larger than this server accepts ({max_bytes} bytes; "
                         f"allspark-serve --max-body-mb)", code="request_too_large", headers={"Connection": "close"})


async def read_json(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    body = b"".join(chunks)
    del chunks
    try:
        value = json.loads(body)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise _too_deep("") from None
    check_json(value)
    return value


def _too_deep(where: str) -> ApiError:
    where = where if len(where) <= 60 else where[:60] + "..."
    return bad_request(f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep"
                       + (f" (at {where})" if where else ""))


def _path(node) -> str:
    """'messages[0].content' from the (parent, key) chain check_json keeps."""
    parts = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def _check_text(text: str, node, key: bool = False) -> None:
    m = _SURROGATE.search(text)
    if m:
        path = _path(node)
        where = ("a key in " if key else "") + (path or "the request body")
        raise bad_request(f"{where} holds a lone UTF-16 surrogate ({ascii(m.group())} at character {m.start()}): "
                          f"JSON strings must be valid Unicode text", param=path or None)


def check_json(value: Any) -> None:
    """400 when `value` nests deeper than MAX_DEPTH or a string (or key) in it holds a lone surrogate. Iterative:
    no recursion on the client's structure."""
    stack = [(value, None, 1)] if isinstance(value, (str, list, dict)) else []   # (value, (parent, key) chain, depth)
    while stack:
        v, node, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, node)
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(_path(node))
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for key, x in items:
            if isinstance(key, str):
                _check_text(key, node, key=True)
            if isinstance(x, (str, list, dict)):
                stack.append((x, (node, key), depth + 1))
