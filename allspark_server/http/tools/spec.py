"""Tool definitions and tool_choice, validated: OpenAI `tools` -> ToolSpec list, `tool_choice` -> ToolChoice.

Errors are ToolError(message, param) naming the bad field (tools[2].function.parameters, ...); each HTTP route
turns them into its own error body. A tool's `parameters` must be a valid JSON schema (checked against its
meta-schema with jsonschema); names follow OpenAI's rule (a-z, A-Z, 0-9, _ and -, at most 64 characters).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_TOOLS = 128                                  # OpenAI's limit on `tools`
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICE_MODES = ("none", "auto", "required")


class ToolError(ValueError):
    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))   # a JSON schema
    strict: bool = False

    def openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                      # "none", "auto", "required" or "named"
    name: Optional[str] = None     # the tool of "named"


def check_schema(schema: Any, where: str) -> dict:
    """`schema` as a JSON schema object; ToolError when it is not an object or breaks its meta-schema."""
    import jsonschema
    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise ToolError(f"Invalid schema for function parameters ({where}{path}): {e.message}", where) from None
    return schema


def check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"{where} must be a string of 1 to 64 characters a-z, A-Z, 0-9, _ or -, got {name!r:.80}",
                        where)
    return name


def validate_tools(tools: Any, param: str = "tools") -> list[ToolSpec]:
    """OpenAI's `tools` -> ToolSpecs (ToolError naming the bad entry)."""
    if not isinstance(tools, list):
        raise ToolError(f"'{param}' must be an array", param)
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"'{param}' holds {len(tools)} tools, more than the {MAX_TOOLS} allowed", param)
    specs, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                             dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got {tool!r:.80}",
                            where)
        extra = set(tool) - {"type", "function"}
        if extra:
            raise ToolError(f"{where} has unknown keys {sorted(extra)}", where)
        fn = tool["function"]
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolError(f"{where}.function has unknown keys {sorted(extra)}", f"{where}.function")
        name = check_name(fn.get("name"), f"{where}.function.name")
        if name in seen:
            raise ToolError(f"Duplicate function name {name!r} in '{param}': each tool needs a unique name",
                            f"{where}.function.name")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        strict = fn.get("strict") or False
        if not isinstance(strict, bool):
            raise ToolError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        parameters = fn.get("parameters")
        parameters = dict(EMPTY_PARAMETERS) if parameters is None else check_schema(
            parameters, f"{where}.function.parameters")
        specs.append(ToolSpec(name, description, parameters, strict))
    return specs


def parse_tool_choice(value: Any, specs: list[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's `tool_choice` (default: "auto" with tools, "none" without) -> ToolChoice."""
    if value is None:
        return ToolChoice("auto" if specs else "none")
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise ToolError(f"Invalid value for '{param}': {value!r:.80}. Supported values are: 'none', 'auto', "
                            "'required' or an object naming a function", param)
        if value != "none" and not specs:
            raise ToolError(f"'{param}' {value!r} needs 'tools'", param)
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str):
            raise ToolError(f"'{param}.function.name' must be a string", f"{param}.function.name")
        if name not in {s.name for s in specs}:
            raise ToolError(f"'{param}' names the function {name!r:.80}, which is not in 'tools'",
                            f"{param}.function.name")
        return ToolChoice("named", name)
    raise ToolError(f"'{param}' must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                    f"{{\"name\": ...}}}}, got {value!r:.80}", param)
