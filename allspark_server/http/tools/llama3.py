"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), after an
optional `<|python_tag|>`; several calls are separated by `;`. An answer that starts otherwise is text."""
from __future__ import annotations

from allspark_server.http.tools.base import Malformed, Seg, ToolCallParser, object_call, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = (TAG, "{")

    def segments(self, text: str, final: bool) -> list[Seg]:
        i = skip_ws(text, 0)
        if not final and (i == len(text) or (TAG.startswith(text[i:]) and text[i:] != TAG)):
            return [Seg(raw=text)]                      # undecided yet
        if text.startswith(TAG, i):
            i = skip_ws(text, i + len(TAG))
            if i == len(text):
                return [Seg(raw=text)]
        if text[i:i + 1] != "{":
            return [Seg(text=text)]
        segs: list[Seg] = []
        start = 0
        while True:
            try:
                seg, end = object_call(text, i, ("parameters", "arguments"))
            except Malformed:
                if segs and not final:
                    raise
                return [Seg(text=text)] if not segs else segs + [Seg(text=text[start:])]
            if end is None:
                seg.raw = text[start:]
                return segs + [seg]
            k = skip_ws(text, end)
            if k < len(text) and text[k] == ";":
                seg.raw = text[start:k + 1]
                segs.append(seg)
                start, i = k + 1, skip_ws(text, k + 1)
                if i == len(text):
                    return segs + ([Seg(raw=text[start:])] if not final else [])
                if text[i] != "{":
                    return segs + [Seg(text=text[start:])]
                continue
            seg.raw = text[start:k]
            return segs + [seg, Seg(text=text[k:])]
