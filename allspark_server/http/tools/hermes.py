"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any
number of them, with text before (and between) them."""
from __future__ import annotations

from allspark_server.http.tools.base import Malformed, Seg, ToolCallParser, held_back, object_call, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = (OPEN,)

    def segments(self, text: str, final: bool) -> list[Seg]:
        segs: list[Seg] = []
        i = 0
        while True:
            at = text.find(OPEN, i)
            if at < 0:
                rest = text[i:] if final else held_back(text[i:], self.markers)
                segs.append(Seg(text=rest))
                return segs
            segs.append(Seg(text=text[i:at]))
            j = skip_ws(text, at + len(OPEN))
            if j == len(text):
                segs.append(Seg(raw=text[at:]))
                return segs
            try:
                seg, end = object_call(text, j)
            except Malformed:
                if not final:
                    raise
                segs.append(Seg(raw=text[at:]))      # broken: the rest is text
                return segs
            if end is None:
                seg.raw = text[at:]
                segs.append(seg)
                return segs
            k = skip_ws(text, end)
            if text.startswith(CLOSE, k):
                k += len(CLOSE)
            elif not final and CLOSE.startswith(text[k:]):   # its closing tag may be on its way
                seg.raw = text[at:]
                segs.append(seg)
                return segs
            else:                                            # a closing tag is optional
                k = end
            seg.raw = text[at:k]
            segs.append(seg)
            i = k
