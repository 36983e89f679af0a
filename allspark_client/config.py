"""Runtime and generation configuration: frozen dataclasses validated on construction, plus builders.

Owns `AsModelConfig` (what `install_model` takes), `AsModelRuntimeConfigBuilder` (DashInfer's fluent
builder), `GenerationConfig` (one request's validated sampling parameters) and
`ASGenerationConfigBuilder`. Torch-free. Every rejection is a `ConfigError` naming the key.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from allspark_client.types import AsCacheMode, AsStatus, TargetDevice

SPAN_SIZES = (16, 32, 64, 128)
MAX_TOP_LOGPROBS = 10
INT64_MAX = 2**63 - 1   # integers travel as int64 to a pool
DEFAULT_PREFILL_CHUNK = 1024


class ConfigError(ValueError):
    """A configuration value is invalid; `status` is the AsStatus to report."""

    def __init__(self, message: str, status: AsStatus = AsStatus.ALLSPARK_PARAM_ERROR):
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------------------------
# Runtime config
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AsModelConfig:
    model_name: str
    model_path: str
    weights_path: str
    compute_unit: str = "CPU:0"
    engine_max_length: int = 2048
    engine_max_batch: int = 32
    engine_max_prefill_length: int = 0      # per-step token budget for chunked prefill; 0 = auto
    num_threads: int = 0                    # compute threads per rank; 0 = leave torch's default
    matmul_precision: str = "highest"
    cache_mode: AsCacheMode = AsCacheMode.AsCacheDefault
    cache_span_size: int = 32
    kv_cache_memory_bytes: int = 0          # KV budget per rank; 0 = enough for max_batch x max_length
    enable_prefix_cache: bool = False
    prefix_cache_ttl: int = 300

    def __post_init__(self):
        _check(bool(self.model_name) and isinstance(self.model_name, str), "model_name must be a non-empty string")
        _check_int("engine_max_length", self.engine_max_length, lo=3)
        _check_int("engine_max_batch", self.engine_max_batch, lo=1)
        _check_int("engine_max_prefill_length", self.engine_max_prefill_length, lo=0)
        _check_int("num_threads", self.num_threads, lo=0)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, lo=0)
        _check(self.cache_span_size in SPAN_SIZES,
               f"cache_span_size must be one of {SPAN_SIZES}, got {self.cache_span_size!r}")
        _check(self.matmul_precision in ("highest", "high", "medium", "medium_bf16"),
               f"matmul_precision must be highest/high/medium, got {self.matmul_precision!r}")
        _check(self.cache_mode in {m.value for m in AsCacheMode},
               f"cache_mode must be one of {[m.name for m in AsCacheMode]}, got {self.cache_mode!r}")
        _check(AsCacheMode(self.cache_mode) == AsCacheMode.AsCacheDefault,
               "cache_mode int8/uint4 (quantized KV spans) is not supported yet; use AsCacheDefault")
        _check(not self.enable_prefix_cache, "enable_prefix_cache is not supported yet; leave it False")
        device, _ = parse_compute_unit(self.compute_unit)
        _check(device != "CUDA", "compute_unit CUDA is not supported yet; use CPU:0")

    @property
    def max_prefill_tokens(self) -> int:
        return self.engine_max_prefill_length or DEFAULT_PREFILL_CHUNK


def parse_compute_unit(unit: str) -> tuple[str, list[int]]:
    """'CPU:0,1' -> ('CPU', [0, 1])."""
    _check(isinstance(unit, str) and ":" in unit, f"compute_unit must look like 'CPU:0', got {unit!r}")
    kind, _, ids = unit.partition(":")
    kind = kind.strip().upper()
    _check(kind in ("CPU", "CUDA"), f"compute_unit device must be CPU or CUDA, got {kind!r}")
    try:
        id_list = [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"compute_unit ids must be integers, got {ids!r}") from None
    _check(len(id_list) > 0, f"compute_unit needs at least one device id, got {unit!r}")
    return kind, id_list


class AsModelRuntimeConfigBuilder:
    """Fluent builder for AsModelConfig (DashInfer's names); `build()` validates."""

    def __init__(self):
        self._fields: dict[str, Any] = {}

    def model_name(self, name: str):
        self._fields["model_name"] = name
        return self

    def model_dir(self, model_dir: str, file_prefix: str):
        self._fields["model_path"] = os.path.join(model_dir, file_prefix + ".asgraph")
        self._fields["weights_path"] = os.path.join(model_dir, file_prefix + ".asparam")
        return self

    def model_file_path(self, graph_path: str, weights_path: str):
        self._fields["model_path"], self._fields["weights_path"] = graph_path, weights_path
        return self

    def compute_unit(self, target_device, device_id_array=None, compute_thread_in_device: int = 0):
        device = target_device if isinstance(target_device, TargetDevice) else TargetDevice(str(target_device).upper())
        ids = list(device_id_array or [0])
        kind = "CUDA" if device == TargetDevice.CUDA else "CPU"
        if device == TargetDevice.CPU:
            ids = [0]
        self._fields["compute_unit"] = f"{kind}:{','.join(str(i) for i in ids)}"
        self._fields["num_threads"] = compute_thread_in_device
        return self

    def max_length(self, n: int):
        self._fields["engine_max_length"] = n
        return self

    def max_batch(self, n: int):
        self._fields["engine_max_batch"] = n
        return self

    def max_prefill_length(self, n: int):
        self._fields["engine_max_prefill_length"] = n
        return self

    def kv_cache_mode(self, mode: AsCacheMode):
        self._fields["cache_mode"] = mode
        return self

    def kv_cache_span_size(self, n: int):
        self._fields["cache_span_size"] = n
        return self

    def kv_cache_memory(self, num_bytes: int):
        self._fields["kv_cache_memory_bytes"] = num_bytes
        return self

    def prefill_cache(self, enable: bool = True):
        self._fields["enable_prefix_cache"] = enable
        return self

    def prefix_cache_ttl(self, ttl: int = 300):
        self._fields["prefix_cache_ttl"] = ttl
        return self

    def matmul_precision(self, precision: str):
        self._fields["matmul_precision"] = precision
        return self

    def update_from_dict(self, d: dict):
        allowed = set(AsModelConfig.__dataclass_fields__)
        for k, v in d.items():
            _check(k in allowed, f"unknown runtime config key {k!r}")
            self._fields[k] = v
        return self

    def build(self) -> AsModelConfig:
        for key in ("model_name", "model_path", "weights_path"):
            _check(key in self._fields, f"runtime config is missing {key}")
        try:
            cfg = AsModelConfig(**self._fields)
        except TypeError as e:
            raise ConfigError(str(e)) from None
        self._fields = dict(self._fields)
        return cfg


# ------------------------------------------------------------------------------------------------
# Generation config
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerationConfig:
    """One request's sampling parameters after validation. `None` max_length = engine_max_length."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 0
    max_length: Optional[int] = None
    max_new_tokens: Optional[int] = None
    eos_token_ids: Optional[tuple[int, ...]] = None   # None: the model's own EOS ids
    stop_words_ids: tuple[tuple[int, ...], ...] = ()
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    do_sample: bool = True

    @property
    def is_greedy(self) -> bool:
        return (not self.do_sample) or self.top_k == 1 or self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# DashInfer keys we accept for compatibility; each only with the value(s) that mean "off".
_INERT_KEYS = {
    "num_beams": (1,), "num_return_sequences": (1,), "length_penalty": None, "early_stopping": None,
    "no_repeat_ngram_size": (0,), "bad_words_ids": ([],), "uuid": None, "input_len": None, "lora_name": ("", None),
    "vocab": None, "vocab_type": None, "enable_tensors_from_model_inference": (False,),
    "suppress_repetition_in_generation": (False,), "mm_info": (None,),
}
_KNOWN_KEYS = set(GenerationConfig.__dataclass_fields__) - {"eos_token_ids"} | {"eos_token_id", "response_format"}


def parse_generation_config(raw: Optional[dict], vocab_size: Optional[int] = None) -> GenerationConfig:
    """Validate a user dict into a GenerationConfig; raise ConfigError naming the offending key.

    Keys absent from `raw` take the defaults above (eos_token_id absent stays None: the engine
    uses the model's own). Token ids are checked against `vocab_size` when it is known (the server;
    a client checks everything else). Nothing is silently rewritten.
    """
    if raw is None:
        raw = {}
    _check(isinstance(raw, dict), f"generation config must be a dict, got {type(raw).__name__}")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        _check(isinstance(key, str), f"generation config keys must be strings, got {key!r}")
        if key in _INERT_KEYS:
            allowed = _INERT_KEYS[key]
            _check(allowed is None or any(type(value) is type(a) and value == a for a in allowed),
                   f"{key}={value!r} is not supported (allowed: {allowed})")
            continue
        _check(key in _KNOWN_KEYS, f"unknown generation config key {key!r}")
        kw[key] = value

    out: dict[str, Any] = {}
    if "temperature" in kw:
        out["temperature"] = _float("temperature", kw["temperature"], lo=0.0, hi=100.0)
    if "top_k" in kw:
        out["top_k"] = _int("top_k", kw["top_k"], lo=0, hi=INT64_MAX)
    if "top_p" in kw:
        p = _float("top_p", kw["top_p"], lo=0.0, hi=1.0)
        _check(p > 0.0, "top_p must be in (0, 1]; 1.0 disables it")
        out["top_p"] = p
    if "repetition_penalty" in kw:
        r = _float("repetition_penalty", kw["repetition_penalty"], lo=0.0, hi=2.0)
        _check(r > 0.0, "repetition_penalty must be in (0, 2]; 1.0 disables it")
        out["repetition_penalty"] = r
    for key in ("presence_penalty", "frequency_penalty"):
        if key in kw:
            out[key] = _float(key, kw[key], lo=-2.0, hi=2.0)
    if "min_length" in kw:
        out["min_length"] = _int("min_length", kw["min_length"], lo=0, hi=INT64_MAX)
    for key in ("max_length", "max_new_tokens"):
        if key in kw and kw[key] is not None:
            out[key] = _int(key, kw[key], lo=1, hi=INT64_MAX)
    if "eos_token_id" in kw:
        out["eos_token_ids"] = _token_list("eos_token_id", kw["eos_token_id"], vocab_size)
    if "stop_words_ids" in kw:
        words = kw["stop_words_ids"]
        _check(isinstance(words, (list, tuple)), "stop_words_ids must be a list of token-id lists")
        seqs = []
        for w in words:
            _check(isinstance(w, (list, tuple)) and len(w) > 0,
                   f"stop_words_ids entries must be non-empty lists of token ids, got {w!r}")
            seqs.append(_token_list("stop_words_ids", list(w), vocab_size))
        out["stop_words_ids"] = tuple(seqs)
    if "seed" in kw and kw["seed"] is not None:
        out["seed"] = _int("seed", kw["seed"], lo=0, hi=2**64 - 1)
    if "logprobs" in kw:
        _check(isinstance(kw["logprobs"], bool), f"logprobs must be a bool, got {kw['logprobs']!r}")
        out["logprobs"] = kw["logprobs"]
    if "top_logprobs" in kw:
        out["top_logprobs"] = _int("top_logprobs", kw["top_logprobs"], lo=0, hi=MAX_TOP_LOGPROBS)
    if "do_sample" in kw:
        _check(isinstance(kw["do_sample"], bool), f"do_sample must be a bool, got {kw['do_sample']!r}")
        out["do_sample"] = kw["do_sample"]
    if "response_format" in kw:
        rf = kw["response_format"]
        _check(rf in (None, {}) or (isinstance(rf, dict) and rf.get("type") == "text"),
               f"response_format={rf!r} is not supported yet (only {{'type': 'text'}})")
    return GenerationConfig(**out)


def parse_input_ids(raw: Any, vocab_size: Optional[int] = None) -> list[int]:
    """input_ids as a torch tensor, numpy array, list or tuple, shaped [L] or [1, L] -> list[int].

    Raises ConfigError (EMPTY_REQUEST for an empty prompt, PARAM_ERROR otherwise). Torch-free:
    tensors and arrays are read through `.tolist()`.
    """
    if hasattr(raw, "tolist") and not isinstance(raw, list):
        raw = raw.tolist()
    if isinstance(raw, tuple):
        raw = list(raw)
    _check(isinstance(raw, list),
           f"input_ids must be a list, numpy array or torch tensor, got {type(raw).__name__}")
    if raw and isinstance(raw[0], (list, tuple)):
        _check(len(raw) == 1, f"input_ids holds a batch of {len(raw)}; start one request per prompt")
        raw = list(raw[0])
    _check(len(raw) > 0, "input_ids is empty", AsStatus.ALLSPARK_EMPTY_REQUEST)
    limit = vocab_size or 2**63
    for t in raw:
        _check(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < limit,
               f"input_ids must be token ids in [0, {vocab_size or '2^63'}), found {t!r}")
    return raw


def resolve_max_length(gen: GenerationConfig, prompt_len: int, engine_max_length: int) -> int:
    """Total length (prompt + output) the request may reach; ConfigError(EXCEED_LIMIT) if none left."""
    limit = engine_max_length if gen.max_length is None else gen.max_length
    if limit > engine_max_length:
        raise ConfigError(f"max_length {limit} exceeds engine_max_length {engine_max_length}",
                          AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR)
    if gen.max_new_tokens is not None:
        limit = min(limit, prompt_len + gen.max_new_tokens)
    if prompt_len >= limit:
        raise ConfigError(f"prompt of {prompt_len} tokens leaves no room to generate under "
                          f"max_length {limit}", AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR)
    return limit


class ASGenerationConfigBuilder:
    """Builds a generation-config dict (DashInfer's builder); `update()` is the main entry point."""

    def __init__(self, base: Optional[dict] = None):
        self._cfg: dict[str, Any] = dict(base or {})

    def update(self, d: dict):
        self._cfg.update(d)
        return self

    def do_sample(self, flag: bool = True):
        self._cfg["do_sample"] = flag
        return self

    def early_stopping(self, flag: bool = True):
        self._cfg["early_stopping"] = flag
        return self

    def log_probs(self, enable: bool, top_logprobs: int = 0):
        self._cfg.update(logprobs=enable, top_logprobs=top_logprobs)
        return self

    def build(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._cfg.items()}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _check(cond: bool, message: str, status: AsStatus = AsStatus.ALLSPARK_PARAM_ERROR) -> None:
    if not cond:
        raise ConfigError(message, status)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or type(v).__name__ in ("int64", "int32")


def _int(key: str, v, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    _check(_is_int(v), f"{key} must be an integer, got {v!r} ({type(v).__name__})")
    v = int(v)
    _check(lo is None or v >= lo, f"{key} must be >= {lo}, got {v}")
    _check(hi is None or v <= hi, f"{key} must be <= {hi}, got {v}")
    return v


_check_int = _int


def _float(key: str, v, lo: float, hi: float) -> float:
    _check((isinstance(v, (int, float)) and not isinstance(v, bool)) or type(v).__name__.startswith("float"),
           f"{key} must be a number, got {v!r} ({type(v).__name__})")
    v = float(v)
    _check(math.isfinite(v) and lo <= v <= hi, f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def _token_list(key: str, v, vocab_size: Optional[int]) -> tuple[int, ...]:
    if v is None:
        return ()
    items = [v] if _is_int(v) else v
    _check(isinstance(items, (list, tuple)), f"{key} must be an int or a list of ints, got {v!r}")
    out = []
    for t in items:
        _check(_is_int(t) and 0 <= int(t) < (vocab_size or 2**63),
               f"{key} entries must be token ids in [0, {vocab_size or '2^63'}), got {t!r}")
        out.append(int(t))
    return tuple(out)


__all__ = ["AsModelConfig", "AsModelRuntimeConfigBuilder", "ASGenerationConfigBuilder", "ConfigError",
           "GenerationConfig", "parse_generation_config", "parse_input_ids", "resolve_max_length", "parse_compute_unit",
           "SPAN_SIZES"]
