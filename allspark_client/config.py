"""Runtime configuration: `AsModelConfig` (what `install_model` takes, validated on construction)
and DashInfer's fluent `AsModelRuntimeConfigBuilder`. Torch-free.

The generation-config names are re-exported here for convenience (they live in generation_config.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from allspark_client.generation_config import (
    ASGenerationConfigBuilder,
    GenerationConfig,
    parse_generation_config,
    parse_input_ids,
    resolve_max_length,
)
from allspark_client.types import AsCacheMode, TargetDevice
from allspark_client.validation import ConfigError, _check
from allspark_client.validation import _int as _check_int

SPAN_SIZES = (16, 32, 64, 128)
CACHE_MODE_NAMES = {"default": AsCacheMode.AsCacheDefault, "int8": AsCacheMode.AsCacheQuantI8,
                    "uint4": AsCacheMode.AsCacheQuantU4, "fp8": AsCacheMode.AsCacheQuantFp8}
SPECULATIVE_METHODS = ("", "ngram", "draft")
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "draft": 4}
# speculate only while at most this many requests run (speculative_max_batch = 0): docs/speculative.md says why
AUTO_SPECULATIVE_MAX_BATCH = 4
MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_ROWS = ("auto", "alone", "invariant")
DEFAULT_PREFILL_CHUNK = 1024
# GPU ranks: a step of 4096 prompt tokens still takes tens of milliseconds on a 7B model, and fewer, larger
# prefill steps save each one's eager launch overhead (128 prompts of 128 tokens: 4 steps instead of 16)
DEFAULT_PREFILL_CHUNK_GPU = 4096


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
    enable_prefix_cache: bool = True        # reuse the KV of prompt prefixes seen before (DashInfer: prefill_cache)
    prefix_cache_ttl: int = 300             # seconds a cached prefix nobody uses stays reusable
    prefix_cache_host_bytes: int = 0        # per rank: host memory for spans evicted from the cache (0 = none)
    enable_profiling: bool = False          # time every op of every step (get_op_profiling_info; AS_PROFILE=ON)
    # speculative decoding (docs/speculative.md): "" off, "ngram" (prompt lookup) or "draft" (a smaller model)
    speculative_method: str = ""
    num_speculative_tokens: int = 0         # tokens proposed per step; 0 = the method's default
    prompt_lookup_min: int = 2              # ngram: the shortest suffix looked up in the request's own tokens
    prompt_lookup_max: int = 4              # ... and the longest (tried first)
    draft_model: str = ""                   # draft: a HF folder, a .gguf file or an .asgraph file (+ .asparam)
    draft_dtype: str = ""                   # draft: its dtype ("" = the file's)
    draft_quantize: str = ""                # draft: InstantQuant format of its copy ("" = none, "int4", "uint4_g128")
    speculative_max_batch: int = 0          # speculate only while at most this many requests decode; 0 = auto
    # GPU ranks: how a verify step's rows are computed as alone (docs/speculative.md, "On a GPU"): "alone" (each by
    # the one-row kernels), "invariant" (a tensor-core GEMV, in every step), "auto" (runner/model_runner.py's rule)
    speculative_rows: str = "auto"
    # LoRA adapters (docs/api.md, "LoRA adapters"): how many may be loaded at once, and the largest rank of one
    lora_max_num: int = 5
    lora_max_rank: int = 64

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
        if isinstance(self.cache_mode, str):   # DashInfer's DIConfig spelling: "int8", "uint4", "default"
            _check(self.cache_mode.lower() in CACHE_MODE_NAMES, f"cache_mode must be one of "
                   f"{sorted(CACHE_MODE_NAMES)} or an AsCacheMode, got {self.cache_mode!r}")
            object.__setattr__(self, "cache_mode", CACHE_MODE_NAMES[self.cache_mode.lower()])
        _check(isinstance(self.cache_mode, int) and not isinstance(self.cache_mode, bool)
               and self.cache_mode in {m.value for m in AsCacheMode},
               f"cache_mode must be one of {[m.name for m in AsCacheMode]}, got {self.cache_mode!r}")
        object.__setattr__(self, "cache_mode", AsCacheMode(self.cache_mode))
        _check(isinstance(self.enable_prefix_cache, bool),
               f"enable_prefix_cache must be a bool, got {self.enable_prefix_cache!r}")
        _check_int("prefix_cache_ttl", self.prefix_cache_ttl, lo=1)
        _check_int("prefix_cache_host_bytes", self.prefix_cache_host_bytes, lo=0)
        _check(isinstance(self.enable_profiling, bool),
               f"enable_profiling must be a bool, got {self.enable_profiling!r}")
        parse_compute_unit(self.compute_unit)   # validates; whether the GPU exists is the rank's to say
        self._check_speculative()
        _check_int("lora_max_num", self.lora_max_num, lo=0)
        _check_int("lora_max_rank", self.lora_max_rank, lo=1)

    def _check_speculative(self) -> None:
        _check(self.speculative_method in SPECULATIVE_METHODS,
               f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, lo=0, hi=MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, lo=1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, lo=1)
        _check(self.prompt_lookup_min <= self.prompt_lookup_max,
               f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
               f"({self.prompt_lookup_max})")
        _check_int("speculative_max_batch", self.speculative_max_batch, lo=0)
        _check(self.speculative_rows in SPECULATIVE_ROWS,
               f"speculative_rows must be one of {SPECULATIVE_ROWS}, got {self.speculative_rows!r}")
        for key in ("draft_model", "draft_dtype", "draft_quantize"):
            _check(isinstance(getattr(self, key), str), f"{key} must be a string")
        _check((self.speculative_method == "draft") == bool(self.draft_model),
               "speculative_method 'draft' needs draft_model (a path), and draft_model needs that method")

    @property
    def speculative_tokens(self) -> int:
        """Tokens proposed per step: num_speculative_tokens, or the method's default (0: speculation off)."""
        if not self.speculative_method:
            return 0
        return self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS[self.speculative_method]

    @property
    def speculative_batch(self) -> int:
        """Most running requests at which proposals are still made (0: speculation off)."""
        if not self.speculative_method:
            return 0
        return self.speculative_max_batch or AUTO_SPECULATIVE_MAX_BATCH

    @property
    def max_prefill_tokens(self) -> int:
        if self.engine_max_prefill_length:
            return self.engine_max_prefill_length
        return (DEFAULT_PREFILL_CHUNK_GPU if parse_compute_unit(self.compute_unit)[0] == "CUDA"
                else DEFAULT_PREFILL_CHUNK)


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

    def kv_cache_mode(self, mode: "AsCacheMode | str"):
        """AsCacheMode.AsCacheDefault (the model's dtype), AsCacheQuantI8 / AsCacheQuantU4 / AsCacheQuantFp8
        (quantized spans; fp8 on GPUs of compute capability 8.9+), or their names "default" / "int8" / "uint4" /
        "fp8"."""
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

    def prefix_cache_host_memory(self, num_bytes: int):
        """A second tier under the prefix cache: spans it evicts are copied into this much host memory (per rank)
        and copied back on a hit instead of being recomputed."""
        self._fields["prefix_cache_host_bytes"] = num_bytes
        return self

    def profiling(self, enable: bool = True):
        """Time the ops of every step on every rank: get_op_profiling_info(name) prints them (DashInfer: AS_PROFILE=ON,
        which allspark reads as well)."""
        self._fields["enable_profiling"] = enable
        return self

    def speculative_decoding(self, method: str, num_speculative_tokens: int = 0, **options):
        """Speculative decoding: `method` "ngram" (prompt lookup over each request's own tokens; options
        prompt_lookup_min, prompt_lookup_max) or "draft" (options draft_model=PATH, draft_dtype, draft_quantize);
        speculative_max_batch: speculate only while at most that many requests decode (0 = auto); speculative_rows:
        how GPU ranks compute a verify step's rows ("auto", "alone", "invariant"). Greedy output is the same as
        without it; sampled output keeps the model's distribution. None or "" turns it off."""
        allowed = {"prompt_lookup_min", "prompt_lookup_max", "draft_model", "draft_dtype", "draft_quantize",
                   "speculative_max_batch", "speculative_rows"}
        for key in options:
            _check(key in allowed, f"unknown speculative_decoding option {key!r} (known: {sorted(allowed)})")
        self._fields.update(speculative_method=method or "", num_speculative_tokens=num_speculative_tokens,
                            **{k: str(v) if k == "draft_model" else v for k, v in options.items()})
        return self

    def lora_max_num(self, n: int):
        """How many LoRA adapters may be loaded at once (DashInfer's default: 5; 0: none)."""
        self._fields["lora_max_num"] = n
        return self

    def lora_max_rank(self, n: int):
        """The largest rank a LoRA adapter may have (DashInfer's default: 64)."""
        self._fields["lora_max_rank"] = n
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


__all__ = ["AsModelConfig", "AsModelRuntimeConfigBuilder", "ConfigError", "SPAN_SIZES", "SPECULATIVE_METHODS",
           "parse_compute_unit",
           # re-exported from generation_config
           "ASGenerationConfigBuilder", "GenerationConfig", "parse_generation_config", "parse_input_ids",
           "resolve_max_length"]
