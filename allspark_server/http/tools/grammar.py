"""Grammars that force tool calls (tool_choice "required" or a named function) or constrain the calls a model
starts by itself (`auto`), in llguidance's Lark syntax.

A forcing grammar emits exactly one call in the parser's own syntax (so the parser reads it back), with the call's
arguments written by `%json{<the tool's schema>}`: they always parse and match the schema. JSON is written as the
server's guided output writes it (", " and ": ", no other whitespace), so a model cannot loop on whitespace.
The server runs it as response_format {"type": "lark", "lark": <grammar>} (allspark_server/runner/guided.py).
"""
from __future__ import annotations

import json
from typing import Mapping, Optional

from allspark_server.http.tools.spec import ToolChoice, ToolSpec

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _args(spec: ToolSpec) -> str:
    schema = dict(spec.parameters)
    schema.setdefault("x-guidance", JSON_STYLE)
    return "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _marker(text: str, special: Mapping[str, int]) -> str:
    """A call marker in Lark: the special token itself (`<[id]>`) when the tokenizer has it as one, else text."""
    return f"<[{special[text]}]>" if text in special else _lit(text)


def _call(spec: ToolSpec, parser: str) -> tuple[str, str, str]:
    """(the call's marker, the text between it and the arguments, the text after them) of one call to `spec` in
    `parser`'s syntax."""
    name = json.dumps(spec.name)
    if parser == "hermes":
        return "<tool_call>", f'\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
    if parser == "llama3_json":
        return "", f'{{"name": {name}, "parameters": ', "}"
    if parser == "mistral":
        return "[TOOL_CALLS]", f'[{{"name": {name}, "arguments": ', "}]"
    if parser == "glm4":
        return "", f"{spec.name}\n", ""
    raise ValueError(f"no tool-call grammar for the parser {parser!r}")


def _calls(chosen: list[ToolSpec], parser: str, special: Mapping[str, int], lines: list[str],
           with_marker: bool = True) -> str:
    """Rules call_k (the whole call, marker first unless with_marker is False) and args_k; returns the
    alternatives."""
    alts = []
    for k, spec in enumerate(chosen):
        marker, before, after = _call(spec, parser)
        parts = ([_marker(marker, special)] if marker and with_marker else []) + [_lit(before), f"args_{k}"]
        alts.append(f"call_{k}")
        lines.append(f"call_{k}: " + " ".join(parts + ([_lit(after)] if after else [])))
        lines.append(f"args_{k}: {_args(spec)}")
    return " | ".join(alts)


# parsers whose calls start with a marker anywhere in the text: `auto` constrains what follows the marker
LAZY_PARSERS = ("hermes", "mistral")


def tool_grammar(specs: list[ToolSpec], choice: ToolChoice, parser: str,
                 special: Optional[Mapping[str, int]] = None) -> Optional[str]:
    """The Lark grammar forcing one call (required / named), or for `auto` letting text run free until a call's
    marker and constraining the call from there (a lazy lexeme ends the text at the marker); None when nothing is
    constrained (`none`, or `auto` with a format whose calls have no marker: llama3_json, glm4).
    `special`: the call markers that are special tokens of the tokenizer, and their ids."""
    special = special or {}
    lines: list[str] = []
    if choice.mode in ("required", "named"):
        chosen = list(specs) if choice.mode == "required" else [s for s in specs if s.name == choice.name]
        return "\n".join([f"start: {_calls(chosen, parser, special, lines)}"] + lines) + "\n"
    if choice.mode != "auto" or parser not in LAZY_PARSERS or not specs:
        return None
    marker = _call(specs[0], parser)[0]
    alts = _calls(list(specs), parser, special, lines, with_marker=False)
    if marker in special:             # a special token never appears in text: no lazy lexeme needed
        head = [f"call: TEXT {_marker(marker, special)} ({alts})"]
    else:
        head = ["call: call_open (" + alts + ")", f"call_open[lazy]: TEXT {_lit(marker)}"]
    return "\n".join(["%llguidance {}", "start: call* TEXT", *head, "TEXT: /(.|\\n)*/"] + lines) + "\n"
