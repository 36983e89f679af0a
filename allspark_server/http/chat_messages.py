"""A chat request's `messages` checked: roles, content (a string, or parts: text, and image_url data: URLs for
vision-language models), an assistant message's tool_calls; 400s naming the message and field.
"""
from __future__ import annotations

from typing import Any, Optional

from allspark_server.http.errors import bad_request

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")   # OpenAI's, less the deprecated one:
TOOL_ROLES = ("function",)                                         # refused with `functions`


def _content_parts(parts: list, where: str, images: list[str]) -> Any:
    """Text parts joined into one string; with image_url parts (data: URLs, appended to `images` in order), the
    parts as a chat template of a vision-language model takes them: text parts and {"type": "image"}."""
    out, has_image = [], False
    for p, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
            continue
        if kind != "image_url":
            raise bad_request(f"{where}[{p}]: parts must be text or image_url, got {part!r:.80}", param=where)
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url.startswith("data:"):
            raise bad_request(f"{where}[{p}].image_url: only data: URLs (the image inline, base64) are accepted; "
                              f"this server fetches no remote images, got {str(url)[:80]!r}", param=where,
                              code="image_url_not_allowed")
        images.append(url)
        out.append({"type": "image"})
        has_image = True
    return out if has_image else "\n".join(part["text"] for part in out)


def messages_of(messages: Any, images: Optional[list] = None) -> list[dict]:
    """The chat's messages checked; the image_url parts' data: URLs are appended to `images`."""
    if not messages:
        raise bad_request("messages must be a non-empty array", param="messages")
    images = [] if images is None else images
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        if m["role"] in TOOL_ROLES:
            raise bad_request(f"messages[{i}].role {m['role']!r} is not supported by this server (use 'tool')",
                              param=f"messages[{i}].role")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(f"Invalid value for messages[{i}].role: {m['role']!r:.80}. Supported values are: "
                              + ", ".join(map(repr, CHAT_ROLES)), param=f"messages[{i}].role", code="invalid_value")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text, and images for vision-language models
            content = _content_parts(content, f"messages[{i}].content", images)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or an array of text parts",
                              param=f"messages[{i}].content")
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                  param=f"messages[{i}].tool_calls")
            _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        msg = {k: v for k, v in m.items() if k not in ("content",)}
        msg["content"] = content if content is not None else ""
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", param=where)
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), (str, dict)) and c.get("type", "function") == "function"):
            raise bad_request(f"{where}[{k}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}, got {c!r:.80}", param=f"{where}[{k}]")
    return calls


def text_chars(value: Any) -> int:
    """Characters in the strings of a message (content, name, ...): what its chat template can render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(map(text_chars, value))
    return 0
