"""What a chat template receives with tools: the tools in OpenAI's shape (transformers' `tools=` convention), the
history's tool calls with their arguments as dicts (what templates iterate over), and, for a template that ignores
`tools`, a system message describing them and the Hermes call format the parser then reads."""
from __future__ import annotations

import json
from typing import Optional

from allspark_server.http.tools.spec import ToolSpec


def template_tools(specs: list[ToolSpec]) -> list[dict]:
    return [s.openai() for s in specs]


def template_uses_tools(template_text: Optional[str]) -> bool:
    """Whether a chat template reads the `tools` variable."""
    import re
    return bool(template_text) and re.search(r"\btools\b", template_text) is not None


def _arguments(value):
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> the template's: each assistant tool call as {"id", "type", "function": {"name",
    "arguments": <dict>}} (also its name and arguments at the top level, as some templates read them)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            conv = []
            for c in calls:
                fn = dict(c.get("function") or {})
                fn["arguments"] = _arguments(fn.get("arguments", {}))
                conv.append({**c, "type": c.get("type", "function"), "function": fn, "name": fn.get("name"),
                             "arguments": fn["arguments"]})
            m = {**m, "tool_calls": conv}
        out.append(m)
    return out


def tools_system_prompt(specs: list[ToolSpec]) -> str:
    """The tools described for a template with no tool support; calls asked for in the Hermes format."""
    lines = ["You can call these functions (JSON schemas of their arguments given):"]
    for s in specs:
        lines.append(json.dumps(s.openai()["function"], ensure_ascii=False))
    lines.append('To call a function, answer with <tool_call>{"name": <function name>, "arguments": <arguments as '
                 "a JSON object>}</tool_call> (one such block per call).")
    return "\n".join(lines)


def history_as_text(messages: list[dict]) -> list[dict]:
    """The history's tool results as user messages and assistant calls as Hermes text: what any template renders."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": _arguments(c["function"].get("arguments"))},
                                                         ensure_ascii=False) + "</tool_call>"
                              for c in m["tool_calls"])
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()}
        out.append(m)
    return out


def with_tools_prompt(messages: list[dict], specs: list[ToolSpec]) -> list[dict]:
    """The messages with the tools' description as (or in front of) the system message, the history as text."""
    prompt = tools_system_prompt(specs)
    out = history_as_text(messages)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": prompt + "\n\n" + (out[0].get("content") or "")}] + out[1:]
    return [{"role": "system", "content": prompt}] + out
