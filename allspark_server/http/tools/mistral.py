"""Mistral tool calls after `[TOOL_CALLS]`: a JSON list `[{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers),
or `name[ARGS]{...}` (v11+, one marker per call). Text before the first marker is content."""
from __future__ import annotations

import re

from allspark_server.http.tools.base import (
    Malformed,
    Seg,
    ToolCallParser,
    held_back,
    json_args_call,
    object_call,
    skip_ws,
)

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]*")


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = (MARK,)

    def segments(self, text: str, final: bool) -> list[Seg]:
        at = text.find(MARK)
        if at < 0:
            return [Seg(text=text if final else held_back(text, self.markers))]
        segs = [Seg(text=text[:at])]
        i = skip_ws(text, at + len(MARK))
        if i == len(text):
            return segs + [Seg(raw=text[at:])]
        if text[i] == "[":
            return segs + self._list(text, i, final)
        while True:                                   # name[ARGS]{...} ([TOOL_CALLS] name[ARGS]{...})*
            m = _NAME.match(text, i)
            j = m.end()
            if not text.startswith(ARGS, j):
                if not final and ARGS.startswith(text[j:]):
                    return segs + [Seg(raw=text[at:])]
                return segs + [Seg(text=text[at:])]
            k = skip_ws(text, j + len(ARGS))
            if k == len(text):
                return segs + [Seg(raw=text[at:])]
            try:
                seg, end = json_args_call(text, k, m.group())
            except Malformed:
                return segs + [Seg(text=text[at:])]
            if end is None:
                return segs + [seg]
            segs.append(seg)
            nxt = skip_ws(text, end)
            if text.startswith(MARK, nxt):
                at, i = nxt, skip_ws(text, nxt + len(MARK))
                if i == len(text):
                    return segs + [Seg(raw=text[at:])]
                continue
            tail = text[end:]
            return segs + [Seg(text=tail if final else held_back(tail, self.markers))]

    def _list(self, text: str, i: int, final: bool) -> list[Seg]:
        segs: list[Seg] = []
        j = skip_ws(text, i + 1)
        while j < len(text):
            if text[j] == "]":
                return segs + [Seg(text=text[j + 1:])]
            try:
                seg, end = object_call(text, j)
            except Malformed:
                if not final:
                    raise
                return segs + [Seg(text=text[j:])]
            if end is None:
                return segs + [seg]
            segs.append(seg)
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
        return segs
