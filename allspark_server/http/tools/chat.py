"""Tools on the server's chat path: what the chat template receives, the grammar a forced call runs under, and
a choice's output turned into OpenAI's tool_calls (whole message or stream deltas).

`ServerTools` is the server's (one per model: the parser, whether its template reads `tools`, the special tokens
the detokenizer must keep because a call marker is one); `ChatToolOutput` is one choice's. Requests carry their
validated tools and tool_choice (ApiRequest.tools / .tool_choice); this module never touches the engine.
"""
from __future__ import annotations

from typing import Optional, Sequence

from allspark_server.http.tools.calls import TextDelta, ToolArgsDelta, ToolCall, ToolCallStart
from allspark_server.http.tools.grammar import tool_grammar
from allspark_server.http.tools.parsers import PARSERS, ToolCallParser, parser_name_for
from allspark_server.http.tools.spec import ToolChoice, ToolSpec
from allspark_server.http.tools.template import (
    history_as_text,
    template_messages,
    template_tools,
    template_uses_tools,
    with_tools_prompt,
)


def tools_active(specs: Sequence[ToolSpec], choice: Optional[ToolChoice]) -> bool:
    return bool(specs) and choice is not None and choice.mode != "none"


class ServerTools:
    def __init__(self, tokenizer, template_text: Optional[str], flag: Optional[str] = None):
        self.template_reads_tools = template_uses_tools(template_text)
        # a template that ignores `tools` gets the Hermes format described in a system message
        self.parser_name = parser_name_for(template_text, flag) if (flag or self.template_reads_tools) else "hermes"
        markers = PARSERS[self.parser_name].markers
        special = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self.special_markers = {m: special[m] for m in markers if m in special}   # written as those tokens
        self.marker_ids = frozenset(self.special_markers.values())
        self.special_ids = frozenset(special.values())

    def template_input(self, messages: list[dict], specs: Sequence[ToolSpec],
                       choice: Optional[ToolChoice]) -> tuple[list[dict], Optional[list[dict]]]:
        """(messages, tools) for the chat template. The tools are left out with tool_choice "none"."""
        has_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if not self.template_reads_tools:
            if tools_active(specs, choice):
                return with_tools_prompt(messages, list(specs)), None
            if has_history:                          # the calls and results as plain text
                return history_as_text(messages), None
            return messages, None
        tools = template_tools(list(specs)) if tools_active(specs, choice) else None
        return template_messages(messages), tools

    def response_format(self, specs: Sequence[ToolSpec], choice: Optional[ToolChoice]) -> Optional[dict]:
        """The guided-output format of a request's calls (tools/grammar.py): forcing one (tool_choice required or
        named), or constraining those the model starts (auto, formats with a call marker); else None."""
        if not tools_active(specs, choice):
            return None
        grammar = tool_grammar(list(specs), choice, self.parser_name, self.special_markers)
        return None if grammar is None else {"type": "lark", "lark": grammar}

    def parser(self, specs: Sequence[ToolSpec]) -> ToolCallParser:
        return PARSERS[self.parser_name]([s.name for s in specs])

    def detokenizer_skip_ids(self) -> Optional[frozenset]:
        """When a call marker is a special token: the special ids to skip while keeping the markers' (decode with
        special tokens kept); None: decode as usual."""
        return (self.special_ids - self.marker_ids) if self.marker_ids else None


class ChatToolOutput:
    """One choice's output read for tool calls: `deltas(text)` while streaming, `finish()` at its end, or
    `message(text)` for a whole response."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self._stream = parser.stream()
        self.num_calls = 0

    def deltas(self, text: str) -> list[dict]:
        return self._deltas(self._stream.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._deltas(self._stream.finish())

    def _deltas(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, TextDelta):
                if out and "content" in out[-1]:
                    out[-1]["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
                self.num_calls += 1
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolArgsDelta):
                last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
                if last is not None and last["index"] == e.index:
                    last["function"]["arguments"] += e.arguments
                else:
                    out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]})
        return out

    def message(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """A whole output -> (content or None when there is none besides calls, the calls)."""
        content, calls = self.parser.parse(text)
        self.num_calls = len(calls)
        return (content or None) if calls else content, calls

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """"tool_calls" when the choice called a tool and was not cut by its length."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason
