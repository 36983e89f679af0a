"""OpenAI request validation: a JSON body of /v1/chat/completions or /v1/completions -> an ApiRequest, and
an ApiRequest + prompt ids -> an allspark generation config.

Owns the field list of each endpoint (types, the fields we ignore as OpenAI allows, the ones we refuse) and the
OpenAI -> allspark key mapping; chat messages are checked by chat_messages.py, ApiError (OpenAI's error object) is
errors.py's. It does not tokenize, start requests or build responses. Value ranges the engine knows (temperature,
top_p, penalties, seed...) are left to the engine, whose PARAM_ERROR message is turned back into a 400 naming the
OpenAI field (`error_from_engine`).
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Optional

from allspark_client.types import AsStatus
from allspark_server.http.chat_messages import messages_of, text_chars
from allspark_server.http.errors import ApiError, bad_request
from allspark_server.http.token_fields import TokenFieldError, parse_logit_bias, parse_stop_token_ids, stop_words_of

# ---- field tables ---------------------------------------------------------------------------------------------
# kinds: str, int, number, bool, dict, list, stop (str or list of str), prompt, any
_SAMPLING = {"temperature": "number", "top_p": "number", "seed": "int", "presence_penalty": "number",
             "frequency_penalty": "number", "stop": "stop", "stream": "bool", "stream_options": "dict", "n": "int",
             # vLLM's extra sampling fields
             "top_k": "int", "repetition_penalty": "number", "min_tokens": "int", "ignore_eos": "bool",
             "logit_bias": "dict", "stop_token_ids": "list",
             # allspark's: False runs the request without the server's --speculative (docs/speculative.md)
             "speculative": "bool"}
CHAT_FIELDS = {"model": "str", "messages": "list", "max_tokens": "int", "max_completion_tokens": "int",
               "logprobs": "bool", "top_logprobs": "int", "response_format": "dict", "tools": "list",
               "tool_choice": "any", "functions": "list", "function_call": "any", "modalities": "list",
               "audio": "any", "prediction": "any", **_SAMPLING}
COMPLETION_FIELDS = {"model": "str", "prompt": "prompt", "max_tokens": "int", "logprobs": "int", "echo": "bool",
                     "suffix": "any", "best_of": "int", "response_format": "dict", **_SAMPLING}
# documented by OpenAI, no effect on generation: accepted and ignored
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                            "safety_identifier"})
# known but unsupported: refused unless they hold their "off" value
_OFF_VALUES = {"functions": ([], None),
               "function_call": ("none", None), "modalities": (["text"], None), "audio": (None,),
               "prediction": (None,), "suffix": (None, "")}
MAX_STOP_STRINGS = 16
MAX_CHOICES = 128                     # OpenAI's bound on n and best_of
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat: up to the context length)


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "stop":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    if kind == "prompt":
        return isinstance(value, (str, list))
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


_KIND_NAMES = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
               "dict": "an object", "list": "an array", "stop": "a string or an array of strings",
               "prompt": "a string or an array of token ids"}


@dataclass
class ApiRequest:
    """A validated request of either endpoint; `kind` is "chat" or "completion"."""
    kind: str
    model: str                                # the served model's name, or a loaded LoRA adapter's
    messages: Optional[list[dict]] = None     # chat
    prompt: Any = None                        # completion: str or list[int]
    prompt_chars: int = 0                     # characters of text the prompt is made of (0 for token ids)
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False                        # completion: the prompt first (with logprobs: prompt_logprobs)
    min_tokens: int = 0
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)   # generation config keys passed through as they are
    lora_name: str = ""                       # the adapter `model` names ("": the base model)
    tools: list = field(default_factory=list)  # chat: ToolSpecs (http/tools/spec.py)
    tool_choice: Any = None                   # chat: a ToolChoice, None without tools
    images: list = field(default_factory=list)   # chat: the image_url parts' data: URLs, in order
    image_inputs: Optional[dict] = None          # ... as pixel_values / image_grid_thw (http/chat_images.py)
    n: int = 1                                # choices returned
    best_of: int = 0                          # completions: choices generated, the n best returned (0: n)
    stop_token_ids: tuple[int, ...] = ()      # vLLM's: token ids that end the output (left out of its text)
    continue_final: bool = False              # chat: the last (assistant) message is continued, not answered


def _fields(body: Any, table: dict) -> dict:
    """Type-check `body` against `table`; drop ignored fields and nulls; refuse unknown fields by name."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in table and k not in IGNORED_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}", param=unknown[0])
    out = {}
    for key, value in body.items():
        if key in IGNORED_FIELDS or value is None:
            continue
        kind = table[key]
        if not _kind_ok(value, kind):
            raise bad_request(f"'{key}' must be {_KIND_NAMES[kind]}, got {type(value).__name__} {value!r:.80}",
                              param=key)
        if key in _OFF_VALUES and value not in _OFF_VALUES[key]:
            raise bad_request(f"'{key}' is not supported by this server (accepted only as "
                              f"{_OFF_VALUES[key][0]!r})", param=key)
        out[key] = value
    return out


def model_not_found(model: str, served_model: str, adapters: Collection[str] = ()) -> ApiError:
    names = [served_model] + sorted(adapters)
    serves = ", ".join(f"'{n}'" for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return ApiError(404, f"The model '{model:.200}' does not exist (this server serves {serves})", param="model",
                    code="model_not_found")


def _common(kind: str, f: dict, served_model: str, adapters: Collection[str] = ()) -> ApiRequest:
    if "model" not in f:
        raise bad_request("you must provide a model parameter", param="model")
    if f["model"] != served_model and f["model"] not in adapters:
        raise model_not_found(f["model"], served_model, adapters)
    n = f.get("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    stream = f.get("stream", False)
    options = f.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        extra = set(options) - {"include_usage", "include_obfuscation"}
        if extra or not isinstance(options.get("include_usage", False), bool):
            raise bad_request(f"stream_options takes only include_usage (a boolean), got {options!r:.80}",
                              param="stream_options")
    stop = f.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or any(s == "" for s in stop):
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    min_tokens = f.get("min_tokens", 0)
    if min_tokens < 0:
        raise bad_request("min_tokens must be >= 0", param="min_tokens")
    sampling = {k: f[k] for k in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
                                  "repetition_penalty", "response_format", "speculative") if k in f}
    try:                                              # token_fields.py: logit_bias and stop_token_ids
        if "logit_bias" in f:
            sampling["logit_bias"] = parse_logit_bias(f["logit_bias"])
        stop_token_ids = parse_stop_token_ids(f.get("stop_token_ids", []))
    except TokenFieldError as e:
        raise bad_request(e.message, param=e.param) from None
    return ApiRequest(kind, f["model"], stream=stream, include_usage=bool(options and options.get("include_usage")),
                      stop=tuple(dict.fromkeys(stop)), min_tokens=min_tokens, ignore_eos=f.get("ignore_eos", False),
                      sampling=sampling, lora_name="" if f["model"] == served_model else f["model"], n=n,
                      stop_token_ids=stop_token_ids)


def _max_tokens(f: dict, *names: str) -> Optional[int]:
    for name in names:
        if name in f:
            if f[name] < 1:
                raise bad_request(f"{name} must be at least 1, got {f[name]}", param=name)
            return f[name]
    return None


def parse_chat(body: Any, served_model: str, adapters: Collection[str] = ()) -> ApiRequest:
    """`adapters`: the loaded LoRA adapters' names, which `model` may name too."""
    f = _fields(body, CHAT_FIELDS)
    req = _common("chat", f, served_model, adapters)
    req.messages = messages_of(f.get("messages"), req.images)
    req.tools, req.tool_choice = _tools(f, (req.sampling.get("response_format") or {}).get("type", "text") != "text")
    req.prompt_chars = sum(map(text_chars, req.messages))
    req.max_tokens = _max_tokens(f, "max_completion_tokens", "max_tokens")
    req.logprobs = f.get("logprobs", False)
    req.top_logprobs = f.get("top_logprobs", 0)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return req


def parse_completion(body: Any, served_model: str, adapters: Collection[str] = ()) -> ApiRequest:
    f = _fields(body, COMPLETION_FIELDS)
    req = _common("completion", f, served_model, adapters)
    req.prompt = _prompt(f.get("prompt"))
    req.prompt_chars = len(req.prompt) if isinstance(req.prompt, str) else 0
    req.echo = f.get("echo", False)
    # max_tokens 0 with echo: the prompt's logprobs alone (lm-evaluation-harness's loglikelihood)
    req.max_tokens = 0 if req.echo and f.get("max_tokens") == 0 else _max_tokens(f, "max_tokens")
    if "logprobs" in f:
        if f["logprobs"] < 0:
            raise bad_request("logprobs must be >= 0", param="logprobs")
        req.logprobs, req.top_logprobs = True, f["logprobs"]
    if f.get("best_of") is not None:
        best_of = f["best_of"]
        if not req.n <= best_of <= MAX_CHOICES:
            raise bad_request(f"best_of must be in [n, {MAX_CHOICES}] (n is {req.n}), got {best_of}", param="best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of cannot be used with stream (the best choices are known only at the end)",
                              param="best_of")
        req.best_of = best_of if best_of > req.n else 0
    return req


def _tools(f: dict, guided: bool) -> tuple[list, Any]:
    """`tools` and `tool_choice` validated (http/tools/spec.py), as 400s naming the bad field."""
    from allspark_server.http.tools import ToolError, parse_tool_choice, validate_tools
    try:
        specs = validate_tools(f.get("tools", []))
        choice = parse_tool_choice(f.get("tool_choice"), specs)
    except ToolError as e:
        raise bad_request(e.message, param=e.param) from None
    if guided and choice.mode in ("required", "named"):
        raise bad_request(f"tool_choice {'required' if choice.mode == 'required' else 'naming a function'} cannot "
                          "be combined with response_format (both constrain the output)", param="tool_choice")
    return specs, choice


def _prompt(prompt: Any):
    if prompt is None:
        raise bad_request("you must provide a prompt", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]      # a batch of one
    if isinstance(prompt, str):
        return prompt
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request("prompt must be a string or a non-empty array of token ids (batches of several prompts "
                          "are not supported: send one request per prompt)", param="prompt")
    return list(prompt)


# ---- generation config ----------------------------------------------------------------------------------------
def max_new_tokens(req: ApiRequest, prompt_len: int, engine_max_length: int) -> int:
    """The output budget: max_tokens, else the room left (completions: OpenAI's default of 16); 400
    (context_length_exceeded) when the prompt leaves no room or max_tokens asks for more than is left."""
    room = engine_max_length - prompt_len
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        asked = f"{prompt_len + (req.max_tokens or 1)} tokens ({prompt_len} in the prompt, " \
                f"{req.max_tokens or 1} for the completion)"
        raise bad_request(f"This model's maximum context length is {engine_max_length} tokens. However, you "
                          f"requested {asked}. Please reduce the length of the prompt or of max_tokens.",
                          param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
    if req.max_tokens is not None:
        return req.max_tokens
    return min(room, COMPLETIONS_DEFAULT_MAX_TOKENS) if req.kind == "completion" else room


def check_prompt_chars(req: ApiRequest, engine_max_length: int, chars_per_token: int) -> None:
    """Before tokenizing: 400 (context_length_exceeded) for a text prompt of more characters than
    engine_max_length tokens of at most `chars_per_token` characters hold, so a huge prompt costs no tokenizer
    time or memory. The exact token count is checked after tokenizing (max_new_tokens)."""
    limit = engine_max_length * chars_per_token
    if req.prompt_chars > limit:
        raise bad_request(f"This model's maximum context length is {engine_max_length} tokens. However, your prompt "
                          f"has {req.prompt_chars} characters, more than {limit} ({chars_per_token} a token): it "
                          f"was refused before tokenizing. Please reduce the length of the prompt.",
                          param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")


def generation_config(req: ApiRequest, prompt_len: int, budget: int, defaults: dict) -> dict:
    """The allspark generation config of a request: the model's defaults, then the request's fields."""
    gen = dict(defaults)
    gen.update(req.sampling)
    if gen.get("response_format", {}).get("type") == "text":
        gen.pop("response_format")
    gen["max_new_tokens"] = max(budget, 1)     # max_tokens 0 (echo): one token made, none returned (serving.py)
    if req.echo and req.logprobs:
        gen["prompt_logprobs"] = req.top_logprobs
    if req.min_tokens:
        if req.min_tokens > budget:
            raise bad_request(f"min_tokens ({req.min_tokens}) exceeds the output budget ({budget})",
                              param="min_tokens")
        gen["min_length"] = prompt_len + req.min_tokens
    if req.ignore_eos:
        gen["eos_token_id"] = []
    if req.stop_token_ids:
        gen["stop_words_ids"] = stop_words_of(req.stop_token_ids)
    if req.logprobs:
        gen["logprobs"], gen["top_logprobs"] = True, req.top_logprobs
    if req.lora_name:
        gen["lora_name"] = req.lora_name
    return gen


# allspark generation-config key -> the OpenAI field that set it (to name `param` in an engine's error)
_ENGINE_KEYS = {"max_new_tokens": "max_tokens", "max_length": "max_tokens", "min_length": "min_tokens",
                "eos_token_id": "ignore_eos", "top_logprobs": "top_logprobs", "logprobs": "logprobs",
                "prompt_logprobs": "logprobs",
                "input_ids": "prompt", "prompt": "prompt", "stop_words_ids": "stop_token_ids"}
_CLIENT_ERRORS = {AsStatus.ALLSPARK_PARAM_ERROR, AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR,
                  AsStatus.ALLSPARK_EMPTY_REQUEST, AsStatus.ALLSPARK_CACHE_MEMORY_OUT}


def error_from_engine(status: AsStatus, message: str, kind: str) -> ApiError:
    """start_request's non-success status and get_last_error() -> 400 (the request's fault) or 503/500."""
    if status in _CLIENT_ERRORS:
        keys = list(_SAMPLING) + ["response_format"] + list(_ENGINE_KEYS)
        m = re.search(r"\b(" + "|".join(sorted(keys, key=len, reverse=True)) + r")\b", message)
        param = _ENGINE_KEYS.get(m.group(1), m.group(1)) if m else None
        if param == "top_logprobs" and kind == "completion":
            param = "logprobs"
        code = "context_length_exceeded" if status in (AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR,
                                                       AsStatus.ALLSPARK_CACHE_MEMORY_OUT) else None
        return bad_request(message or status.name, param=param, code=code)
    if status == AsStatus.ALLSPARK_REQUEST_DENIED:
        return ApiError(503, f"the model is not serving: {message}", code="unavailable")
    if status == AsStatus.ALLSPARK_LORA_NOT_FOUND:       # the adapter was unloaded after the request was read
        return ApiError(404, message or "the LoRA adapter is not loaded", param="model", code="model_not_found")
    return ApiError(500, f"{status.name}: {message}")
