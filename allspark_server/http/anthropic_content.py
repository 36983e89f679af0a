"""Anthropic content blocks and tools, as the rest of the server takes them: `messages` (and `system`) -> the chat
template's messages, `tools` / `tool_choice` -> the tools package's specs and choice.

Blocks: `text` (joined with newlines), an assistant's `tool_use` (its `tool_calls`, input as JSON text), a user's
`tool_result` (a `tool` message naming its call and tool); `image` and `document` refused, earlier `thinking` blocks
dropped. Tools: Anthropic's {name, description, input_schema} validated as OpenAI functions (tools/spec.py), `any`
being `required` and `tool` a named function. Errors are 400 ApiErrors naming the field in Anthropic's dotted form.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from allspark_server.http.protocol import ApiError, bad_request

ROLES = ("user", "assistant")


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


def template_messages(system: Optional[Any], messages: list) -> list[dict]:
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
    if messages[-1].get("role") == "assistant":           # a prefill: the answer goes on from its text
        final = out[-1]
        if final.get("tool_calls") or not final["content"] or final["content"] != final["content"].rstrip():
            raise bad_request(f"messages.{len(messages) - 1}: a final assistant message (a prefill) must be text that "
                              "does not end with whitespace", param=f"messages.{len(messages) - 1}")
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


def tool_specs(tools: list, choice: Optional[dict]) -> tuple[list, Any, bool]:
    """Anthropic's `tools` and `tool_choice` -> (tools.ToolSpec list, tools.ToolChoice, disable_parallel_tool_use)."""
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
        specs = validate_tools(as_openai, param="tools")
        parsed = parse_tool_choice(_openai_choice(choice), specs, param="tool_choice")
    except ToolError as e:
        raise _tool_error(e) from None
    return specs, parsed, bool((choice or {}).get("disable_parallel_tool_use", False))


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
