"""What a tool-call parser produces: a ToolCall (complete) and the events of a streamed one.

Plain data, no parsing here. Arguments stay the JSON text the model wrote (checked to parse as an object), so a
streamed call's argument pieces concatenate to exactly the non-streamed call's `arguments`.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Union


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str                 # the JSON text of an object
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry ({"id", "type", "function": {"name", "arguments"}})."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int                     # the call's position in this answer (0, 1, ...)
    id: str
    name: str


@dataclass
class ToolArgsDelta:
    index: int
    arguments: str                 # the next piece of the call's arguments JSON text


Event = Union[TextDelta, ToolCallStart, ToolArgsDelta]
