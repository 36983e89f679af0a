"""LoRA adapters over HTTP, vLLM's shape: `--lora-modules name=path ...` loaded at start, the bodies of
`POST /v1/load_lora_adapter` ({"lora_name", "lora_path"}) and `POST /v1/unload_lora_adapter` ({"lora_name"}), and the
engine's LoRA statuses as OpenAI error objects with HTTP codes (404 unknown adapter or file, 409 already loaded or in
use, 400 a bad adapter or a limit, 503 a pool that is gone).

Knows nothing of routes or of the engine: app.py calls these, backend.py talks to the engine.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from allspark_client.types import AsStatus
from allspark_server.http.protocol import ApiError, bad_request

MAX_NAME_CHARS = 256
LOAD_FIELDS = {"lora_name": str, "lora_path": str}
UNLOAD_FIELDS = {"lora_name": str, "lora_int_id": int}     # vLLM's body also names an id: accepted, unused

# status -> (HTTP status, OpenAI error code)
_LORA_ERRORS = {
    AsStatus.ALLSPARK_LORA_NOT_FOUND: (404, "lora_not_found"),
    AsStatus.ALLSPARK_LORA_ALREADY_LOADED: (409, "lora_already_loaded"),
    AsStatus.ALLSPARK_LORA_IN_USE: (409, "lora_in_use"),
    AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR: (400, "lora_limit_exceeded"),
    AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR: (400, "lora_rank_exceeded"),
    AsStatus.ALLSPARK_PARAM_ERROR: (400, "invalid_lora_adapter"),
}


def lora_module(value: str) -> tuple[str, str]:
    """One --lora-modules value -> (name, path): `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: not valid JSON: {e}") from None
        extra = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else set()
        if not isinstance(spec, dict) or extra or not all(isinstance(spec.get(k), str) for k in ("name", "path")):
            raise argparse.ArgumentTypeError(f"{value!r}: expected {{\"name\": NAME, \"path\": PATH}}")
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH (an .aslora file or a PEFT folder)")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: both the adapter's name and its path must be non-empty")
    return name, path


def check_lora_modules(modules: list[tuple[str, str]], served_model: str) -> Optional[str]:
    """Why --lora-modules cannot be served (a duplicate name, or the base model's), or None."""
    names = [name for name, _ in modules]
    for name in names:
        if name == served_model:
            return f"--lora-modules: the adapter name {name!r} is the served model's name: pick another one"
        if names.count(name) > 1:
            return f"--lora-modules: the adapter name {name!r} is given more than once"
    return None


def _body(body: Any, table: dict, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise bad_request(f"Unrecognized request argument(s) supplied: {', '.join(unknown)} ({endpoint} takes "
                          f"{', '.join(table)})", param=unknown[0])
    for key, kind in table.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise bad_request(f"'{key}' must be {'a string' if kind is str else 'an integer'}, got "
                              f"{type(value).__name__} {value!r:.80}", param=key)
    return body


def _lora_name(body: dict, served_model: str) -> str:
    name = body.get("lora_name")
    if not name:
        raise bad_request("you must provide lora_name, a non-empty string", param="lora_name")
    if len(name) > MAX_NAME_CHARS:
        raise bad_request(f"lora_name has {len(name)} characters, more than {MAX_NAME_CHARS}", param="lora_name")
    if name == served_model:
        raise bad_request(f"lora_name {name!r} is the served model's name: an adapter needs a name of its own, "
                          f"which requests then send as their `model`", param="lora_name")
    return name


def parse_load(body: Any, served_model: str) -> tuple[str, str]:
    """/v1/load_lora_adapter's body -> (lora_name, lora_path)."""
    f = _body(body, LOAD_FIELDS, "/v1/load_lora_adapter")
    name = _lora_name(f, served_model)
    path = f.get("lora_path")
    if not path:
        raise bad_request("you must provide lora_path: an .aslora file or a PEFT adapter folder, on the server's "
                          "machine (a pool's: its hosts')", param="lora_path")
    return name, path


def parse_unload(body: Any, served_model: str) -> str:
    """/v1/unload_lora_adapter's body -> lora_name."""
    return _lora_name(_body(body, UNLOAD_FIELDS, "/v1/unload_lora_adapter"), served_model)


def lora_error(status: AsStatus, message: str, name: str, loading: bool) -> ApiError:
    """A load_lora (`loading`) or unload_lora status other than success -> its HTTP error."""
    status = AsStatus(status)
    http, code = _LORA_ERRORS.get(status, (500, None))
    # loading: most failures are the adapter's (no such file, its rank, what is in it); unloading: the name's
    param: Optional[str] = "lora_name"
    if status == AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR:
        param = None
    elif loading and (status in (AsStatus.ALLSPARK_LORA_NOT_FOUND, AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR)
                      or (status == AsStatus.ALLSPARK_PARAM_ERROR and "lora_name" not in message)):
        param = "lora_path"
    text = message or f"{status.name} for LoRA adapter {name!r}"
    if http == 500:
        return ApiError(500, f"{status.name}: {text}")
    return ApiError(http, text, param=param, code=code)


def loaded_message(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."      # vLLM's text


def unloaded_message(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."
