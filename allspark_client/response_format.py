"""`response_format` of a generation config: validate the user's value into a ResponseFormat.

Torch-free and grammar-library-free: this only checks the shape of the value (the keys, that a schema is a
JSON object). Whether a schema, regex or grammar compiles is decided on the server (allspark_server.runner.guided),
which reports it as ALLSPARK_PARAM_ERROR too.

Accepted values (None, {} and {"type": "text"} mean plain text):
  {"type": "json_object"}                                   any JSON object
  {"type": "json_object", "json_schema": <schema>}          DashInfer's form: output valid against the schema
  {"type": "json_schema", "json_schema": {"name": ..., "schema": <schema>, "strict": ..., "description": ...}}
                                                            OpenAI's form
  {"type": "json_schema", "json_schema": <schema>}          the schema directly (a dict or a JSON string)
  {"type": "regex", "regex": "<pattern>"}                   output fully matches the regex
  {"type": "lark", "lark": "<grammar>"}                     llguidance's Lark / EBNF grammar
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from allspark_client.validation import ConfigError, _check

KINDS = ("json_object", "json_schema", "regex", "lark")
_OPENAI_WRAPPER_KEYS = {"name", "schema", "strict", "description"}


@dataclass(frozen=True)
class ResponseFormat:
    """A validated response_format. `kind` is one of KINDS; `spec` is the schema as compact JSON text (in the
    user's key order: properties are generated in that order), the regex, or the Lark text ("" for
    json_object)."""
    kind: str
    spec: str

    def to_dict(self) -> dict:
        """A value that parse_response_format turns back into this ResponseFormat."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        if self.kind == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": json.loads(self.spec)}}
        return {"type": self.kind, self.kind: self.spec}

    def to_json(self) -> str:
        """The wire form (GenerationConfig.response_format_json)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> Optional["ResponseFormat"]:
        """Inverse of to_json; "" means plain text (None). Raises ConfigError on a bad value."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"response_format is not valid JSON: {e}") from None
        return parse_response_format(raw)


def _canonical(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _schema(value: Any, where: str) -> str:
    """A JSON schema given as a dict or a JSON string -> its canonical text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{where} is a string but not valid JSON: {e}") from None
    _check(isinstance(value, dict), f"{where} must be a JSON object (a dict or a JSON string of one), "
                                    f"got {type(value).__name__}")
    try:
        return _canonical(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} cannot be written as JSON: {e}") from None


def _json_schema_value(value: Any, where: str) -> str:
    """`json_schema`'s value: OpenAI's {"name", "schema", ...} wrapper or the schema itself."""
    if isinstance(value, dict) and "schema" in value and "name" in value:
        extra = set(value) - _OPENAI_WRAPPER_KEYS
        _check(not extra, f"{where} has unknown keys {sorted(extra)} (allowed: {sorted(_OPENAI_WRAPPER_KEYS)})")
        _check(isinstance(value["name"], str), f"{where}.name must be a string, got {value['name']!r}")
        _check(value.get("strict") is None or isinstance(value["strict"], bool),
               f"{where}.strict must be a bool, got {value.get('strict')!r}")
        return _schema(value["schema"], f"{where}.schema")
    return _schema(value, where)


def parse_response_format(raw: Any) -> Optional[ResponseFormat]:
    """Validate a user's response_format; None for plain text. Raises ConfigError naming the problem."""
    if raw is None:
        return None
    if isinstance(raw, ResponseFormat):
        return raw
    _check(isinstance(raw, dict), f"response_format must be a dict, got {type(raw).__name__}")
    if not raw:
        return None
    _check("type" in raw, f"response_format needs a 'type' key (text, {', '.join(KINDS)}), got keys {sorted(raw)}")
    kind = raw["type"]
    _check(isinstance(kind, str) and kind in ("text",) + KINDS,
           f"response_format type {kind!r} is unknown (allowed: text, {', '.join(KINDS)})")

    def only(*keys: str) -> None:
        extra = set(raw) - {"type", *keys}
        _check(not extra, f"response_format of type {kind!r} has unknown keys {sorted(extra)}")

    if kind == "text":
        only()
        return None
    if kind == "json_object":
        only("json_schema")
        if raw.get("json_schema") is None:
            return ResponseFormat("json_object", "")
        return ResponseFormat("json_schema", _json_schema_value(raw["json_schema"], "response_format.json_schema"))
    if kind == "json_schema":
        only("json_schema")
        _check("json_schema" in raw, "response_format of type 'json_schema' needs a 'json_schema' key")
        return ResponseFormat("json_schema", _json_schema_value(raw["json_schema"], "response_format.json_schema"))
    only(kind)
    _check(kind in raw, f"response_format of type {kind!r} needs a {kind!r} key")
    text = raw[kind]
    _check(isinstance(text, str) and text != "",
           f"response_format.{kind} must be a non-empty string, got {text!r}")
    return ResponseFormat(kind, text)
