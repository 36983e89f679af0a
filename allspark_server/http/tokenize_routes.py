"""vLLM's POST /tokenize and POST /detokenize: a prompt or chat messages -> {"count", "max_model_len", "tokens"}
(and "token_strs" on request), token ids -> {"prompt"}.

Messages are validated as the chat endpoint validates them (protocol.parse_chat, tools included) and rendered by
the same chat template renderer (serving.py), so /tokenize counts exactly the ids a chat request would send, unless
`add_generation_prompt` or `add_special_tokens` say otherwise (defaults as vLLM's: a prompt gets the tokenizer's
special tokens, messages do not; the generation prompt is added). Behind the API key like /v1/* (app.py's
middleware reads PATHS). Owns these two bodies only; it starts no request on the engine.
"""
from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Optional

from starlette.requests import Request

from allspark_server.http.protocol import ApiRequest, bad_request, check_prompt_chars, model_not_found, parse_chat

PATHS = ("/tokenize", "/detokenize")
_TOKENIZE_FIELDS = {"model": str, "prompt": str, "messages": list, "tools": list, "add_generation_prompt": bool,
                    "add_special_tokens": bool, "return_token_strs": bool}
_DETOKENIZE_FIELDS = {"model": str, "tokens": list}


@dataclass
class TokenizeRequest:
    prompt: Optional[str]                 # a prompt's text, or
    chat: Optional[ApiRequest]            # messages (and tools), validated as a chat request
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


def _fields(body: Any, table: dict, served_model: str, adapters: Collection[str]) -> dict:
    """Type-checked fields (nulls dropped); unknown ones refused by name; `model`, when given, one we serve."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in table)
    if unknown:
        raise bad_request(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}", param=unknown[0])
    f = {k: v for k, v in body.items() if v is not None}
    for key, value in f.items():
        if not isinstance(value, table[key]) or (table[key] is not bool and isinstance(value, bool)):
            raise bad_request(f"'{key}' must be {_KIND[table[key]]}, got {type(value).__name__} {value!r:.80}",
                              param=key)
    if "model" in f and f["model"] != served_model and f["model"] not in adapters:
        raise model_not_found(f["model"], served_model, adapters)
    return f


_KIND = {str: "a string", list: "an array", bool: "a boolean"}


def parse_tokenize(body: Any, served_model: str, adapters: Collection[str] = ()) -> TokenizeRequest:
    f = _fields(body, _TOKENIZE_FIELDS, served_model, adapters)
    if ("prompt" in f) == ("messages" in f):
        raise bad_request("give either 'prompt' (a string) or 'messages' (a chat), not both or neither",
                          param="prompt" if "prompt" in f else "messages")
    if "prompt" in f:
        for key in ("tools", "add_generation_prompt"):
            if key in f:
                raise bad_request(f"'{key}' applies to 'messages' only", param=key)
        chat = None
    else:
        chat = parse_chat({"model": served_model, "messages": f["messages"],
                           **({"tools": f["tools"]} if "tools" in f else {})}, served_model, adapters)
    return TokenizeRequest(f.get("prompt"), chat, f.get("add_generation_prompt", True),
                           f.get("add_special_tokens", chat is None), f.get("return_token_strs", False))


def parse_detokenize(body: Any, served_model: str, adapters: Collection[str] = ()) -> list[int]:
    f = _fields(body, _DETOKENIZE_FIELDS, served_model, adapters)
    tokens = f.get("tokens")
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be an array of token ids (integers >= 0)", param="tokens")
    return tokens


def add_tokenize_routes(app, serving, parse) -> None:
    """The two routes on `app`; `parse(parse_request, request)` reads and validates a body (app.py's)."""
    backend = serving.backend
    tokenizer = backend.tokenizer

    async def on_executor(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(backend.executor, fn, *args)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        t = await parse(parse_tokenize, request)
        if t.chat is not None:
            check_prompt_chars(t.chat, backend.engine_max_length, serving.chars_per_token)
            text = await serving._render(t.chat, t.add_generation_prompt)
        else:
            check_prompt_chars(ApiRequest("completion", backend.name, prompt_chars=len(t.prompt)),
                               backend.engine_max_length, serving.chars_per_token)
            text = t.prompt
        ids = (await on_executor(lambda: tokenizer(text, add_special_tokens=t.add_special_tokens)))["input_ids"]
        out = {"count": len(ids), "max_model_len": backend.engine_max_length, "tokens": ids, "token_strs": None}
        if t.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ids = await parse(parse_detokenize, request)
        bad = [t for t in ids if t >= len(tokenizer)]
        if bad:
            raise bad_request(f"'tokens' holds {bad[0]}, not a token id of this model's tokenizer (its ids are "
                              f"0..{len(tokenizer) - 1})", param="tokens")
        return {"prompt": await on_executor(tokenizer.decode, ids)}
