"""The parser framework: a format cuts a model's output (complete or so far) into segments, text and calls; from
those, `parse` builds the final (content, calls) and the streaming parser emits what became certain since its
last feed. Each format (hermes.py, llama3.py, mistral.py, glm4.py) writes only `segments`.

Segments of a text cut short must only grow as it grows: text held back at the end (what may start a call's
marker) is left out until it is certain. So the events streamed reassemble to what `parse` returns at the end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from allspark_server.http.tools.calls import Event, TextDelta, ToolArgsDelta, ToolCall, ToolCallStart, new_call_id
from allspark_server.http.tools.jsonscan import Malformed, is_object_text, scan_object, skip_ws, string_end


@dataclass
class Seg:
    """Text (`text` set) or a call: `name` once known, `args` its arguments' JSON text so far, `done` when the
    call is complete, `raw` the text the call was cut from (what it turns back into if it proves broken)."""
    text: Optional[str] = None
    name: Optional[str] = None
    args: str = ""
    done: bool = False
    raw: str = ""

    @property
    def is_call(self) -> bool:
        return self.text is None


def held_back(text: str, markers: Sequence[str]) -> str:
    """`text` less its longest ending that is a proper prefix of a marker (it may yet become one)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return text[:-n]
    return text


def object_call(s: str, i: int, arg_keys: Sequence[str] = ("arguments", "parameters")) -> tuple[Seg, Optional[int]]:
    """The call written as the JSON object at s[i] ({"name": ..., "arguments": {...}}): its Seg and the object's
    end (None: not ended yet). Raises Malformed when it is not such an object."""
    fields, end = scan_object(s, i)
    seg = Seg(raw=s[i:end] if end is not None else s[i:])
    if "name" in fields:
        a, b = fields["name"]
        if s[a] != '"':
            raise Malformed("the call's name is not a string")
        if b is not None:
            seg.name = json.loads(s[a:b])
    key = next((k for k in arg_keys if k in fields), None)
    if key is not None:
        a, b = fields[key]
        if s[a] != "{":
            raise Malformed("the call's arguments are not an object")
        seg.args = s[a:b] if b is not None else s[a:]
    if end is not None:
        if seg.name is None or (key is None and any(k not in arg_keys + ("name",) for k in fields)):
            raise Malformed("not a tool call object")
        if key is None:
            seg.args = "{}"
        seg.done = True
    return seg, end


def json_args_call(s: str, i: int, name: str) -> tuple[Seg, Optional[int]]:
    """A call written as `name` followed by its arguments' JSON object at s[i]."""
    if s[i] != "{":
        raise Malformed("the arguments are not an object")
    from allspark_server.http.tools.jsonscan import value_end
    end = value_end(s, i)
    return Seg(name=name, args=s[i:end] if end is not None else s[i:], done=end is not None,
               raw=s[i:end] if end is not None else s[i:]), end


def clean(segs: list[Seg]) -> list[Seg]:
    """Text right before a call loses its trailing whitespace; whitespace alone after a call goes."""
    out = []
    for k, seg in enumerate(segs):
        if seg.text is not None:
            if k + 1 < len(segs) and segs[k + 1].is_call and segs[k + 1].name is not None:
                seg = Seg(text=seg.text.rstrip())
            if k > 0 and segs[k - 1].is_call and not seg.text.strip():
                seg = Seg(text="")
        out.append(seg)
    return out


class ToolCallParser:
    """One format. `names`: the request's tool names (a format whose calls carry no marker uses them)."""
    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, names: Sequence[str] = ()):
        self.names = tuple(names)

    def segments(self, text: str, final: bool) -> list[Seg]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A complete output -> (the text outside calls, the calls)."""
        segs = finalize(self.segments(text, final=True))
        content = "".join(s.text for s in segs if not s.is_call)
        return content, [ToolCall(s.name, s.args) for s in segs if s.is_call]

    def stream(self) -> "StreamingToolParser":
        return StreamingToolParser(self)


def finalize(segs: list[Seg]) -> list[Seg]:
    """At the end: a call that is incomplete, nameless or whose arguments do not parse is its text again."""
    segs = [s if not s.is_call or (s.done and s.name and is_object_text(s.args)) else Seg(text=s.raw)
            for s in segs]
    return clean(segs)


class StreamingToolParser:
    """feed(delta) -> the events that became certain; finish() -> the rest."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.buf = ""
        self._emitted: dict[int, int] = {}       # segment index -> characters of its text / arguments sent
        self._calls: dict[int, int] = {}         # segment index -> call index
        self.calls: list[ToolCall] = []          # the calls started so far (arguments grow)

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        try:
            segs = clean(self.parser.segments(self.buf, final=False))
        except Malformed:
            segs = None
        return self._events(segs, final=False) if segs is not None else []

    def finish(self) -> list[Event]:
        segs = finalize(self.parser.segments(self.buf, final=True))
        return self._events(segs, final=True)

    def _events(self, segs: list[Seg], final: bool) -> list[Event]:
        out: list[Event] = []
        for k, seg in enumerate(segs):
            last = k == len(segs) - 1
            sent = self._emitted.get(k, 0)
            if seg.text is not None:
                if k in self._calls:              # streamed as a call already: it stays one
                    continue
                hold = not final and (last or segs[k + 1].is_call)    # may yet end right before a call
                avail = seg.text.rstrip() if hold else seg.text
                if len(avail) > sent:
                    out.append(TextDelta(avail[sent:]))
                    self._emitted[k] = len(avail)
                continue
            if seg.name is None:
                continue
            if k not in self._calls:
                if sent:                          # its text went out already (cannot happen with a sane format)
                    continue
                self._calls[k] = len(self.calls)
                self.calls.append(ToolCall(seg.name, "", new_call_id()))
                call = self.calls[-1]
                out.append(ToolCallStart(self._calls[k], call.id, call.name))
            if len(seg.args) > sent:
                piece = seg.args[sent:]
                self.calls[self._calls[k]].arguments += piece
                out.append(ToolArgsDelta(self._calls[k], piece))
                self._emitted[k] = len(seg.args)
        return out


__all__ = ["Malformed", "Seg", "ToolCallParser", "StreamingToolParser", "held_back", "object_call",
           "json_args_call", "skip_ws", "string_end"]
