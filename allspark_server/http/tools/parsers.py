"""The tool-call parsers by name, and the choice of one: the --tool-call-parser flag, else what the chat
template's text shows (its call syntax), else Hermes (the format the fallback system prompt asks for)."""
from __future__ import annotations

from typing import Optional, Sequence

from allspark_server.http.tools.base import StreamingToolParser, ToolCallParser
from allspark_server.http.tools.glm4 import Glm4Parser
from allspark_server.http.tools.hermes import HermesParser
from allspark_server.http.tools.llama3 import Llama3JsonParser
from allspark_server.http.tools.mistral import MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                  Glm4Parser)}
# (text in a template, the parser its calls need), first match wins
_TEMPLATE_HINTS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ('"parameters": dictionary of argument name', "llama3_json"), ("<|observation|>", "glm4"))


def parser_name_for(template_text: Optional[str], flag: Optional[str] = None) -> str:
    if flag:
        if flag not in PARSERS:
            raise ValueError(f"unknown tool-call parser {flag!r} (known: {', '.join(PARSERS)})")
        return flag
    text = template_text or ""
    return next((name for hint, name in _TEMPLATE_HINTS if hint in text), "hermes")


def parser_for(template_text: Optional[str], flag: Optional[str] = None, names: Sequence[str] = ()) -> ToolCallParser:
    """The parser for a model (see the module's docstring); `names`: the request's tool names."""
    return PARSERS[parser_name_for(template_text, flag)](names)


__all__ = ["PARSERS", "StreamingToolParser", "ToolCallParser", "parser_for", "parser_name_for"]
