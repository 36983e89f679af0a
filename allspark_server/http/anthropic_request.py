"""Anthropic Messages API requests: a JSON body of /v1/messages or /v1/messages/count_tokens -> a MessagesRequest
(an ApiRequest of kind "chat" whose messages are what the chat template receives, plus the tools), and the
Anthropic error object.

Owns the Messages API's field list, its content blocks (text, tool_use, tool_result; images refused) turned into the
template's messages (tool_result blocks become `tool` messages, tool_use blocks an assistant's `tool_calls`), and
`tools` / `tool_choice` mapped onto the tools package's specs. Errors are protocol.ApiError (status, message,
param); `error_body` gives them Anthropic's shape. It does not tokenize, start requests or build responses.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Optional

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
ROLES = ("user", "assistant")
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
    messages = _template_messages(f.get("system"), _required(f, "messages"))
    req = ApiRequest("chat", model, messages=messages, lora_name="" if model == served_model else model)
    req.prompt_chars = _chars(messages)
    out = MessagesRequest(req)
    if f.get("tools"):
        _tools(out, f["tools"], f.get("tool_choice"))
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


# ---- content blocks -> the chat template's messages --------------------------------------------------------------
def _text_of(blocks: Any, where: str, what: str = "text") -> str:
    """A string, or the text of an array of text blocks (joined with newlines)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or an array of {what} blocks", param=where)
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            raise bad_request(f"{where}.{i}: {kind} content blocks are not supported by this server (text only)",
                              param=f"{where}.{i}")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}.{i}: expected a text block ({{\"type\": \"text\", \"text\": ...}}), got "
                              f"{block!r:.80}", param=f"{where}.{i}")
        texts.append(block["text"])
    return "\n".join(texts)


def _template_messages(system: Optional[Any], messages: list) -> list[dict]:
    out = []
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    tool_names: dict[str, str] = {}       # tool_use id -> the tool's name, for the tool_result that answers it
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: must be an object with 'role' and 'content'", param=where)
        extra = set(m) - {"role", "content"}
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad_request(f"{where}.role: must be 'user' or 'assistant' (a system prompt goes in 'system'), got "
                              f"{role!r:.80}", param=f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(role, content, where, tool_names))
        else:
            raise bad_request(f"{where}.content: must be a string or an array of content blocks",
                              param=f"{where}.content")
    if messages[-1].get("role") == "assistant":
        raise bad_request("messages: the last message must be the user's (continuing a partial assistant message is "
                          "not supported by this server)", param=f"messages.{len(messages) - 1}")
    return out


def _blocks(role: str, blocks: list, where: str, tool_names: dict) -> list[dict]:
    """One message's content blocks -> template messages: text joined into one message of `role`; an assistant's
    tool_use blocks become its `tool_calls`; a user's tool_result blocks become `tool` messages (before its text)."""
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text: must be a string", param=f"{at}.text")
            texts.append(block["text"])
        elif kind in ("image", "document"):
            raise bad_request(f"{at}: {kind} content blocks are not supported by this server (text only)", param=at)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue                                   # earlier thinking is not shown to the model again
        elif kind == "tool_use" and role == "assistant":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise bad_request(f"{at}: a tool_use block needs 'id' and 'name' (strings) and 'input' (an object)",
                                  param=at)
            tool_names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{at}.tool_use_id: must be a string", param=f"{at}.tool_use_id")
            text = _text_of(block.get("content", ""), f"{at}.content")
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in tool_names:
                msg["name"] = tool_names[call_id]
            results.append(msg)
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
            raise bad_request(f"{at}: content block type {kind!r:.40} is not accepted in a {role} message "
                              f"(accepted: {allowed})", param=at)
    out = list(results)
    if texts or calls or not results:
        msg = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


# ---- tools ---------------------------------------------------------------------------------------------------
def _tool_error(e) -> ApiError:
    """A tools.ToolError, its OpenAI field names turned into the Messages API's."""
    def anthropic(text: str) -> str:
        return (text.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
                .replace(".function.description", ".description").replace("[", ".").replace("]", ""))
    return bad_request(anthropic(e.message), param=anthropic(e.param) if e.param else None)


def _tools(out: MessagesRequest, tools: list, choice: Optional[dict]) -> None:
    from allspark_server.http.tools import ToolError, parse_tool_choice, validate_tools
    as_openai = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{where}: must be an object with 'name' and 'input_schema'", param=where)
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"{where}.type: {tool['type']!r:.60} is not supported by this server (only custom "
                              "tools, with 'name', 'description' and 'input_schema')", param=f"{where}.type")
        extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param=where)
        if "input_schema" not in tool:
            raise bad_request(f"{where}.input_schema: Field required", param=f"{where}.input_schema")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        as_openai.append({"type": "function", "function": fn})
    try:
        out.tools = validate_tools(as_openai, param="tools")
        out.tool_choice = parse_tool_choice(_openai_choice(choice), out.tools, param="tool_choice")
    except ToolError as e:
        raise _tool_error(e) from None
    out.disable_parallel_tool_use = bool((choice or {}).get("disable_parallel_tool_use", False))


def _openai_choice(choice: Optional[dict]) -> Any:
    """Anthropic's tool_choice -> OpenAI's: auto, any (= required), tool (a named function), none."""
    if choice is None:
        return None
    kind = choice.get("type")
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if extra or kind not in ("auto", "any", "tool", "none") or (kind == "tool") != ("name" in choice):
        raise bad_request("tool_choice: must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                          f"{{\"type\": \"tool\", \"name\": ...}}, got {choice!r:.80}", param="tool_choice")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]
