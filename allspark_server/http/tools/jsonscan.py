"""A scanner of JSON text that may be cut short (a model's output so far): where a value or an object's fields
end, or None when the text ends inside them. Malformed text raises Malformed. The tool-call parsers use it to cut
a call's arguments out of the text exactly as the model wrote them, complete or not yet.
"""
from __future__ import annotations

import json
import re
from typing import Optional

_SCALAR = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?|true|false|null")
WS = " \t\r\n"


class Malformed(ValueError):
    pass


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def string_end(s: str, i: int) -> Optional[int]:
    """End (exclusive) of the string literal starting at s[i] == '"'; None when s ends inside it."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def value_end(s: str, i: int) -> Optional[int]:
    """End (exclusive) of the JSON value starting at s[i] (not whitespace); None when s ends inside it."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                j = string_end(s, j)
                if j is None:
                    return None
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(s, i)
    if m is None:
        if any(w.startswith(s[i:]) for w in ("true", "false", "null", "-")):
            return None
        raise Malformed(f"not a JSON value at {s[i:i + 20]!r}")
    return None if m.end() == len(s) else m.end()


def scan_object(s: str, i: int) -> tuple[dict[str, tuple[int, Optional[int]]], Optional[int]]:
    """The object starting at s[i] == '{': ({key: (value start, value end or None)}, the object's end or None).
    Keys whose value has not started yet are left out."""
    fields: dict[str, tuple[int, Optional[int]]] = {}
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return fields, j + 1
    while j < len(s):
        if s[j] != '"':
            raise Malformed(f"expected a key at {s[j:j + 20]!r}")
        e = string_end(s, j)
        if e is None:
            return fields, None
        key = json.loads(s[j:e])
        j = skip_ws(s, e)
        if j == len(s):
            return fields, None
        if s[j] != ":":
            raise Malformed(f"expected ':' at {s[j:j + 20]!r}")
        j = skip_ws(s, j + 1)
        if j == len(s):
            return fields, None
        end = value_end(s, j)
        fields[key] = (j, end)
        if end is None:
            return fields, None
        j = skip_ws(s, end)
        if j == len(s):
            return fields, None
        if s[j] == "}":
            return fields, j + 1
        if s[j] != ",":
            raise Malformed(f"expected ',' or '}}' at {s[j:j + 20]!r}")
        j = skip_ws(s, j + 1)
    return fields, None


def is_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
