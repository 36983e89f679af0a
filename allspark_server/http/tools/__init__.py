"""Tool calling for the HTTP server: tool definitions, tool_choice, chat-template input, output parsers, grammars.

API (used by the OpenAI chat route and by the Anthropic Messages route):

    validate_tools(tools, param="tools") -> list[ToolSpec]
        OpenAI `tools` ([{"type": "function", "function": {"name", "description", "parameters", "strict"}}]) ->
        ToolSpecs; ToolError(message, param) for a bad entry (an invalid JSON schema, a duplicate name, ...).
        ToolSpec(name, description, parameters: dict, strict) builds one directly (the Anthropic side).
    parse_tool_choice(value, specs, param="tool_choice") -> ToolChoice
        "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} -> ToolChoice(mode, name);
        mode is "none", "auto", "required" or "named"; ToolError for an unknown mode or a name not in specs.
    parser_for(template_text, flag=None, names=()) -> ToolCallParser
        The parser named by `flag` (--tool-call-parser: hermes, llama3_json, mistral, glm4), else the one the
        chat template's text suggests, else hermes; `names`: the request's tool names (glm4 checks them).
        PARSERS: the registry (name -> class).
    ToolCallParser.parse(text) -> (content: str, calls: list[ToolCall])
        A complete output: the text outside calls ("" when none) and the calls in order.
    ToolCallParser.stream() -> StreamingToolParser
        .feed(delta: str) -> list[Event];  .finish() -> list[Event]  (flushes what was held back)
        Events: TextDelta(text) | ToolCallStart(index, id, name) | ToolArgsDelta(index, arguments) (a piece of
        the arguments' JSON text; the pieces of one call concatenate to its ToolCall.arguments).
    ToolCall(id, name, arguments): arguments is the JSON text of an object; id "call_<hex>" (new_call_id()).
    tool_grammar(specs, choice, parser, special=None) -> Optional[str]
        The llguidance Lark grammar that forces `required` (any one of the tools) or a named tool, in the
        parser's own call syntax, the arguments following the tool's schema; for "auto" (hermes, mistral) one
        that leaves text free up to a call's marker and constrains the call; None otherwise. `special`: call
        markers that are special tokens -> their ids. Run as response_format {"type": "lark", "lark": grammar}.
    template_tools(specs) -> list[dict]
        The `tools` a chat template receives (OpenAI's {"type": "function", "function": {...}} shape).
    template_messages(messages) -> list[dict]
        OpenAI history -> the template's dicts: assistant tool_calls with arguments as dicts, `tool` messages
        kept (tool_call_id, name).
    template_uses_tools(template_text) -> bool;  tools_system_prompt(specs, parser) -> str
        A template that ignores `tools` gets the tools described in a system message (Hermes format).

On the server (chat.py): `Serving.tools` is a ServerTools (the model's parser, template input, the guided format of
a request's calls, the detokenizer's special-token handling); an ApiRequest's `tools` / `tool_choice` (ToolSpecs, a
ToolChoice) are rendered and guided by Serving itself; `ChatToolOutput` turns a choice's text into OpenAI deltas.

This package owns no HTTP: errors are ToolError (message, param); each route turns them into its own error shape.
"""
from allspark_server.http.tools.calls import (
    Event,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    new_call_id,
)
from allspark_server.http.tools.grammar import tool_grammar
from allspark_server.http.tools.parsers import PARSERS, StreamingToolParser, ToolCallParser, parser_for
from allspark_server.http.tools.spec import ToolChoice, ToolError, ToolSpec, parse_tool_choice, validate_tools
from allspark_server.http.tools.template import (
    template_messages,
    template_tools,
    template_uses_tools,
    tools_system_prompt,
)

__all__ = ["Event", "PARSERS", "StreamingToolParser", "TextDelta", "ToolArgsDelta", "ToolCall", "ToolCallParser",
           "ToolCallStart", "ToolChoice", "ToolError", "ToolSpec", "new_call_id", "parse_tool_choice", "parser_for",
           "template_messages", "template_tools", "template_uses_tools", "tool_grammar", "tools_system_prompt",
           "validate_tools"]
