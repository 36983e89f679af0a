"""GLM-4 tool calls (glm-4-9b-chat): the whole answer is the function's name on its own line, then its arguments
as a JSON object. An answer whose first line is not a name followed by an object is text; with the request's tool
names known, the first line must be one of them."""
from __future__ import annotations

import re

from allspark_server.http.tools.base import Malformed, Seg, ToolCallParser, json_args_call, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class Glm4Parser(ToolCallParser):
    name = "glm4"
    markers = ()

    def segments(self, text: str, final: bool) -> list[Seg]:
        i = skip_ws(text, 0)
        m = _NAME.match(text, i)
        if m is None:
            return [Seg(raw=text)] if not final and i == len(text) else [Seg(text=text)]
        name = m.group()
        if m.end() == len(text) and not final:
            ok = not self.names or any(n.startswith(name) for n in self.names)
            return [Seg(raw=text)] if ok else [Seg(text=text)]
        if text[m.end()] != "\n" or (self.names and name not in self.names):
            return [Seg(text=text)]
        j = skip_ws(text, m.end())
        if j == len(text):
            return [Seg(raw=text)] if not final else [Seg(text=text)]
        try:
            seg, end = json_args_call(text, j, name)
        except Malformed:
            return [Seg(text=text)]
        seg.raw = text[:end] if end is not None else text
        if end is None:
            return [seg]
        return [seg, Seg(text=text[end:])]
