"""A fixed set of JSON schemas for guided-output tests: nested objects, bounded arrays, enums, ranged numbers,
strings with patterns and lengths, required fields, booleans, nullables, anyOf, $defs/$ref.

Every string has a maxLength (or a pattern, enum or const) and every array a maxItems, and every object
forbids extra properties, so any output the schema admits is short: a random walk ends within ~200 tokens.
"""
from __future__ import annotations


def _obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


_S = {"type": "string", "maxLength": 6}
_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: list[tuple[str, dict]] = [
    ("person", _obj({"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}})),
    ("nested_address", _obj({"name": _S, "address": _obj({"street": {"type": "string", "maxLength": 10},
                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("int_array", {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4}),
    ("enum_color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("bounded_numbers", _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                              "temp": {"type": "number", "minimum": -40, "maximum": 60}})),
    ("booleans", _obj({"active": {"type": "boolean"}, "verified": {"type": "boolean"}})),
    ("nullable", _obj({"nickname": {"type": ["string", "null"], "maxLength": 5},
                       "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10}})),
    ("any_of", _obj({"value": {"anyOf": [_DIGIT, {"type": "string", "maxLength": 3}, {"type": "null"}]}})),
    ("defs_ref", {"$defs": {"point": _obj({"x": _DIGIT, "y": _DIGIT})},
                  **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("array_of_objects", _obj({"items": {"type": "array", "maxItems": 3, "items": _obj(
        {"id": {"type": "integer", "minimum": 1, "maximum": 100}, "tag": {"enum": ["a", "b"]}})}})),
    ("string_lengths", _obj({"code": {"type": "string", "minLength": 2, "maxLength": 4},
                             "note": {"type": "string", "minLength": 0, "maxLength": 3}})),
    ("email_pattern", _obj({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}})),
    ("const_version", _obj({"version": {"const": "v1"}, "ok": {"type": "boolean"}})),
    ("optional_fields", _obj({"a": _DIGIT, "b": {"type": "boolean"}, "c": _S}, required=["b"])),
    ("matrix", _obj({"rows": {"type": "array", "maxItems": 3,
                              "items": {"type": "array", "items": _DIGIT, "maxItems": 3}}})),
    ("mixed_enum", {"enum": [1, "two", None, True, 3.5]}),
    ("exclusive_bounds", _obj({"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}})),
    ("all_of", {"allOf": [_obj({"a": _DIGIT, "b": _S}, required=["a"]), {"required": ["b"]}]}),
    ("unicode_enum", _obj({"word": {"enum": ["café", "naïve", "日本"]}})),
    ("deep_nesting", _obj({"l1": _obj({"l2": _obj({"l3": _obj({"leaf": {"type": "boolean"}})})})})),
    ("tuple_prefix_items", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, _DIGIT,
                                                             {"type": "boolean"}], "items": False, "minItems": 3}),
    ("multiple_of", _obj({"step": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}})),
    ("string_or_int_list", _obj({"vals": {"type": "array", "minItems": 2, "maxItems": 3,
                                          "items": {"type": ["integer", "string"], "minimum": 0, "maximum": 99,
                                                    "maxLength": 2}}})),
    ("order", _obj({"order_id": {"type": "string", "pattern": "^ORD-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "status": {"enum": ["new", "paid", "shipped"]},
                    "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                              "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                                             "price": {"type": "number", "minimum": 0, "maximum": 100}})}})),
    ("top_level_string", {"type": "string", "minLength": 1, "maxLength": 5}),
    ("top_level_integer", {"type": "integer", "minimum": -1000, "maximum": 1000}),
]
