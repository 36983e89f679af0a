"""Anthropic Messages API requests: a JSON body of /v1/messages or /v1/messages/count_tokens -> a MessagesRequest
(an ApiRequest of kind "chat" whose messages are what the chat template receives, plus the tools), and the
Anthropic error object.

Owns the Messages API's top-level field list and values; content blocks and tools are anthropic_content.py's.
Errors are protocol.ApiError (status, message, param); `error_body` gives them Anthropic's shape. It does not
tokenize, start requests or build responses.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Optional

from allspark_server.http.anthropic_content import template_messages, tool_specs
from allspark_server.http.protocol import MAX_STOP_STRINGS, ApiError, ApiRequest, bad_request, model_not_found

# kinds: str, int, number, bool, dict, list, system (a string or an array of text blocks)
MESSAGES_FIELDS = {"model": "str", "max_tokens": "int", "messages": "list", "system": "system",
                   "stop_sequences": "list", "temperature": "number", "top_p": "number", "top_k": "int",
                   "stream": "bool", "tools": "list", "tool_choice": "dict", "output_config": "dict"}
COUNT_TOKENS_FIELDS = {"model": "str", "messages": "list", "system": "system", "tools": "list", "tool_choice": "dict"}
# documented by Anthropic, no effect here: accepted and ignored (`thinking`: the models served write no thinking
# blocks; `cache_control`, here and inside blocks: the prefix cache needs no marks)
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "thinking", "container", "context_management",
                            "cache_control", "inference_geo", "speed", "user_profile_id", "workspace_id",
                            "diagnostics"})
_KIND_NAMES = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
               "dict": "an object", "list": "an array", "system": "a string or an array of text blocks"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: ApiError) -> dict:
    """Anthropic's error object for an ApiError: {"type": "error", "error": {"type", "message"}}; the message names
    the field (`param`, which Anthropic's object has no place for) where it does not already."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    named = not err.param or err.param in err.message
    return {"type": "error", "error": {"type": kind, "message": err.message if named else
                                       f"{err.param}: {err.message}"}}


def is_anthropic_path(path: str) -> bool:
    """The paths whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


@dataclass
class MessagesRequest:
    api: ApiRequest                                   # kind "chat": messages in the template's shape
    tools: list = field(default_factory=list)         # tools.ToolSpec
    tool_choice: Any = None                           # tools.ToolChoice (None: no tools)
    disable_parallel_tool_use: bool = False


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "system":
        return isinstance(value, (str, list))
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def _fields(body: Any, table: dict) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in table and k not in IGNORED_FIELDS)
    if unknown:
        raise bad_request(f"{unknown[0]}: Extra inputs are not permitted"
                          + (f" (also: {', '.join(unknown[1:])})" if unknown[1:] else ""), param=unknown[0])
    out = {}
    for key, value in body.items():
        if key in IGNORED_FIELDS or value is None:
            continue
        if not _kind_ok(value, table[key]):
            raise bad_request(f"{key}: must be {_KIND_NAMES[table[key]]}, got {type(value).__name__} {value!r:.80}",
                              param=key)
        out[key] = value
    return out


def _required(f: dict, name: str) -> Any:
    if name not in f:
        raise bad_request(f"{name}: Field required", param=name)
    return f[name]


def _model(f: dict, served_model: str, adapters: Collection[str]) -> str:
    model = _required(f, "model")
    if model != served_model and model not in adapters:
        err = model_not_found(model, served_model, adapters)
        raise ApiError(404, f"model: {err.message}", param="model", code=err.code)
    return model


def parse_messages(body: Any, served_model: str, adapters: Collection[str] = ()) -> MessagesRequest:
    """A /v1/messages body; `adapters`: the loaded LoRA adapters' names, which `model` may name too."""
    f = _fields(body, MESSAGES_FIELDS)
    out = _conversation(f, served_model, adapters)
    req = out.api
    max_tokens = _required(f, "max_tokens")
    if max_tokens < 1:
        raise bad_request(f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
    req.max_tokens = max_tokens
    req.stream = f.get("stream", False)
    stops = f.get("stop_sequences", [])
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop_sequences: at most {MAX_STOP_STRINGS} non-empty strings", param="stop_sequences")
    req.stop = tuple(dict.fromkeys(stops))
    req.sampling = {k: f[k] for k in ("temperature", "top_p", "top_k") if k in f}
    schema = _output_schema(f.get("output_config", {}))
    if schema is not None:
        req.sampling["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return out


def _output_schema(config: dict) -> Optional[dict]:
    """output_config: `format` {"type": "json_schema", "schema": ...} (guided output); `effort` is ignored."""
    extra = set(config) - {"effort", "format"}
    if extra:
        raise bad_request(f"output_config.{sorted(extra)[0]}: Extra inputs are not permitted", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)
            and set(fmt) <= {"type", "schema"}):
        raise bad_request("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}, got "
                          f"{fmt!r:.80}", param="output_config.format")
    return fmt["schema"]


def parse_count_tokens(body: Any, served_model: str, adapters: Collection[str] = ()) -> MessagesRequest:
    """A /v1/messages/count_tokens body: the conversation of a /v1/messages body, without generation fields."""
    return _conversation(_fields(body, COUNT_TOKENS_FIELDS), served_model, adapters)


def _conversation(f: dict, served_model: str, adapters: Collection[str]) -> MessagesRequest:
    model = _model(f, served_model, adapters)
    messages = template_messages(f.get("system"), _required(f, "messages"))
    req = ApiRequest("chat", model, messages=messages, lora_name="" if model == served_model else model,
                     continue_final=messages[-1]["role"] == "assistant")
    req.prompt_chars = _chars(messages) + _chars(f.get("tools"))     # tools reach the prompt too
    out = MessagesRequest(req)
    if f.get("tools"):
        out.tools, out.tool_choice, out.disable_parallel_tool_use = tool_specs(f["tools"], f.get("tool_choice"))
    elif f.get("tool_choice") not in (None, {"type": "none"}, {"type": "auto"}):
        raise bad_request("tool_choice: needs tools", param="tool_choice")
    return out


def _chars(value: Any) -> int:
    """Characters in the strings of the messages: what their chat template can render (the prompt check's)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_chars, value.values()))
    return sum(map(_chars, value)) if isinstance(value, list) else 0
