"""Anthropic Messages API response bodies: the `message` object and the server-sent events of a streamed one
(message_start, content_block_start / _delta / _stop per block, message_delta, message_stop; `error` mid-stream),
and GET /v1/models in the shape Anthropic's clients read.

Pure functions of what a request produced (text, tool calls, stop reason, token counts); no I/O, no engine. Field
names and shapes follow Anthropic's API reference, so the official `anthropic` client parses them.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Optional


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def event(name: str, data: dict) -> bytes:
    """One server-sent event: Anthropic's streams name each event (`event:`) and repeat the name as data's type."""
    return (f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def tool_use_block(call_id: str, name: str, arguments: str) -> dict:
    """A tool_use content block; `arguments` is the JSON text of an object (as the tool-call parsers give it)."""
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}


def message(msg_id: str, model: str, content: list[dict], stop_reason: Optional[str], stop_sequence: Optional[str],
            input_tokens: int, output_tokens: int) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(input_tokens, output_tokens)}


def model_list(names: list[str], created: int, max_length: int) -> dict:
    """GET /v1/models as Anthropic's clients read it (a page of ModelInfo); `created` in Unix seconds."""
    at = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
    data = [{"type": "model", "id": n, "display_name": n, "created_at": at, "lifecycle": "active",
             "max_input_tokens": max_length, "max_tokens": max_length} for n in names]
    return {"data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]}


class EventStream:
    """The events of one streamed message, block by block: text opens a text block (unless one is open), a tool
    call opens a tool_use block; a new block closes the open one. Each method returns the bytes to send."""

    def __init__(self, msg_id: str, model: str):
        self.id, self.model = msg_id, model
        self._index = -1             # the open block's index (-1: none yet)
        self._open: Optional[str] = None     # its type

    def start(self, input_tokens: int) -> bytes:
        return event("message_start", {"type": "message_start", "message": message(
            self.id, self.model, [], None, None, input_tokens, 0)})

    def _open_block(self, block: dict) -> bytes:
        out = self._close_block()
        self._index += 1
        self._open = block["type"]
        return out + event("content_block_start", {"type": "content_block_start", "index": self._index,
                                                   "content_block": block})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._open_block({"type": "text", "text": ""}) if self._open != "text" else b""
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                   "delta": {"type": "text_delta", "text": text}})

    def tool_start(self, call_id: str, name: str) -> bytes:
        return self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_args(self, partial_json: str) -> bytes:
        if not partial_json:
            return b""
        return event("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                             "delta": {"type": "input_json_delta", "partial_json": partial_json}})

    def finish(self, stop_reason: str, stop_sequence: Optional[str], output_tokens: int) -> bytes:
        return (self._close_block()
                + event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": {"output_tokens": output_tokens}})
                + event("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error(body: dict) -> bytes:
        """An error after the response began (its status is sent already): Anthropic's error object as an event."""
        return event("error", body)
