"""Grammars that force tool calls (tool_choice "required" or a named function), in llguidance's Lark syntax.

The grammar emits exactly one call in the parser's own syntax (so the parser reads it back), with the call's
arguments written by `%json{<the tool's schema>}`: they always parse and match the schema. JSON is written as the
server's guided output writes it (", " and ": ", no other whitespace), so a model cannot loop on whitespace.
The server runs it as response_format {"type": "lark", "lark": <grammar>} (allspark_server/runner/guided.py).
"""
from __future__ import annotations

import json
from typing import Optional

from allspark_server.http.tools.spec import ToolChoice, ToolSpec

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _args(spec: ToolSpec) -> str:
    schema = dict(spec.parameters)
    schema.setdefault("x-guidance", JSON_STYLE)
    return "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _call(spec: ToolSpec, parser: str) -> tuple[str, str]:
    """(the text before the arguments, the text after them) of one call to `spec` in `parser`'s syntax."""
    name = json.dumps(spec.name)
    if parser == "hermes":
        return f'<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
    if parser == "llama3_json":
        return f'{{"name": {name}, "parameters": ', "}"
    if parser == "mistral":
        return f'[TOOL_CALLS][{{"name": {name}, "arguments": ', "}]"
    if parser == "glm4":
        return f"{spec.name}\n", ""
    raise ValueError(f"no tool-call grammar for the parser {parser!r}")


def tool_grammar(specs: list[ToolSpec], choice: ToolChoice, parser: str) -> Optional[str]:
    """The Lark grammar forcing one call (see the module's docstring); None when nothing is forced."""
    if choice.mode == "required":
        chosen = list(specs)
    elif choice.mode == "named":
        chosen = [s for s in specs if s.name == choice.name]
    else:
        return None
    lines, alts = [], []
    for k, spec in enumerate(chosen):
        before, after = _call(spec, parser)
        alts.append(f"call_{k}")
        lines.append(f"call_{k}: {_lit(before)} args_{k}" + (f" {_lit(after)}" if after else ""))
        lines.append(f"args_{k}: {_args(spec)}")
    return "\n".join([f"start: {' | '.join(alts)}"] + lines) + "\n"
