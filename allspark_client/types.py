"""Public, torch-free value types shared by `Engine` and `ClientEngine`.

Owns the enums (AsStatus, GenerateRequestStatus, AsCacheMode, TargetDevice), the per-step output
(`GeneratedElements`), per-request timing (`RequestStatInfo`), the engine statistics (`AsEngineStat`)
and the exception raised by calls that do not return a status. Names follow DashInfer's.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Optional

# How the error ends that a pool gives every open stream when it cannot go on (a hung step, a lost rank).
POOL_DOWN = "the pool is going down"
# How ClientEngine words a stream the pool took away with it (a lost connection, a stream closed without an end;
# client.py's _read_stream).
LOST_POOL = ("lost the pool at ", "closed the stream")


def pool_failed(error: Optional[str]) -> bool:
    """The error a request ended with says its pool went away, not that the request itself failed (ClientEngine's
    sync_request then fails; the HTTP server answers 503 "unavailable")."""
    return bool(error) and (error.endswith(POOL_DOWN) or any(words in error for words in LOST_POOL))


class AsStatus(enum.IntEnum):
    ALLSPARK_SUCCESS = 0
    ALLSPARK_UNKNOWN_ERROR = 1
    ALLSPARK_PARAM_ERROR = 2
    ALLSPARK_IO_ERROR = 3
    ALLSPARK_MEMORY_ERROR = 4
    ALLSPARK_RUNTIME_ERROR = 5
    ALLSPARK_EXCEED_LIMIT_ERROR = 7
    ALLSPARK_INVALID_CALL_ERROR = 8
    ALLSPARK_EMPTY_REQUEST = 9
    ALLSPARK_ILLEGAL_REQUEST_ID = 10
    ALLSPARK_CACHE_MEMORY_OUT = 11
    ALLSPARK_REQUEST_DENIED = 12
    ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR = 21
    ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR = 22
    ALLSPARK_LORA_NOT_FOUND = 23
    ALLSPARK_LORA_ALREADY_LOADED = 24
    ALLSPARK_LORA_IN_USE = 25
    ALLSPARK_STREAMING = 200


class GenerateRequestStatus(enum.IntEnum):
    Init = 0
    ContextFinished = 1
    Generating = 2
    GenerateFinished = 3
    GenerateInterrupted = 4
    InternalError = 5

    @property
    def is_terminal(self) -> bool:
        return self >= GenerateRequestStatus.GenerateFinished


class AsCacheMode(enum.IntEnum):
    AsCacheDefault = 0
    AsCacheQuantI8 = 1
    AsCacheQuantU4 = 2
    AsCacheQuantFp8 = 3     # allspark's: e4m3 spans on GPUs of compute capability 8.9+ (DashInfer has none)


class TargetDevice(enum.Enum):
    CPU = "CPU"
    CPU_NUMA = "CPU_NUMA"
    CUDA = "CUDA"


class AsException(RuntimeError):
    """Raised by calls that DashInfer also raises from (install_model, get_model_info, ...).

    `status` carries the AsStatus; the message names what was wrong.
    """

    def __init__(self, status: AsStatus, message: str):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


@dataclass
class GeneratedElements:
    """Tokens produced since the previous `ResultQueue.Get*` call, with optional logprobs.

    log_probs_list[i] holds the top_logprobs (token_id, logprob) pairs of the i-th new token;
    token_logprobs_list[i] the logprob of the token actually chosen.
    With the generation config's `prompt_logprobs`, the first elements of a request carry the prompt's, once:
    prompt_logprobs[i] = log P(prompt[i] | prompt[:i]) (None at position 0), prompt_top_logprobs[i] the top
    (token_id, logprob) pairs of position i's distribution ([] at position 0); both None otherwise.
    """
    ids_from_generate: list[int] = field(default_factory=list)
    log_probs_list: list[list[tuple[int, float]]] = field(default_factory=list)
    token_logprobs_list: list[float] = field(default_factory=list)
    prefix_cache_len: int = 0
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list[list[tuple[int, float]]]] = None

    def extend(self, other: "GeneratedElements") -> None:
        self.ids_from_generate.extend(other.ids_from_generate)
        self.log_probs_list.extend(other.log_probs_list)
        self.token_logprobs_list.extend(other.token_logprobs_list)
        self.prefix_cache_len = max(self.prefix_cache_len, other.prefix_cache_len)
        if other.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = other.prompt_logprobs, other.prompt_top_logprobs


@dataclass
class RequestStatInfo:
    """Timings in milliseconds since the epoch (times) or milliseconds (durations)."""
    arrival_time: int = 0
    first_token_time: int = 0
    last_token_time: int = 0
    finished_time: int = 0
    time_to_first_token: int = 0
    time_in_queue: int = 0
    context_token_length: int = 0
    generated_token_length: int = 0
    context_cached_length: int = 0
    context_tps: float = 0.0
    generate_tps: float = 0.0

    def dict(self) -> dict:
        return asdict(self)


@dataclass
class AsEngineStat:
    """A snapshot of one model's serving state (DashInfer field names, its typo included)."""
    model_name: str = ""
    free_token: int = 0
    total_token: int = 0
    pendding_request: int = 0
    running_request: int = 0
    total_generated_token: int = 0
    total_prefill_token: int = 0
    generate_token_persec: float = 0.0
    process_token_persec: float = 0.0
    total_span: int = 0
    used_span: int = 0
    free_span: int = 0
    span_size: int = 0
    token_usage_percentage: float = 0.0
    num_preempted: int = 0
    prefix_cache_hit_token: int = 0
    prefix_cache_miss_token: int = 0
    prefix_cache_hit_rate: float = 0.0      # hit / (hit + miss) prompt tokens since start
    prefix_cache_miss_rate: float = 0.0
    prefix_cache_spans: int = 0             # spans holding cached prefixes that no request uses now
    prefix_cache_host_spans: int = 0        # prefixes kept in the second tier (host memory)
    memory_bandwidth_gbs: float = 0.0       # copy bandwidth of the memory the model decodes from (all ranks, once)
    memory_bandwidth_utilization: float = 0.0   # MBU of the decode-only steps of the last 10 s (0..~1)
    rank_memory_bandwidth_gbs: list[float] = field(default_factory=list)           # the same, per rank
    rank_memory_bandwidth_utilization: list[float] = field(default_factory=list)
    asleep: bool = False                    # unload_device_mem freed its memory; load_device_mem wakes it
    # speculative decoding (docs/speculative.md), since the model was installed
    spec_draft_tokens: int = 0              # tokens proposed and checked by a verify step
    spec_accepted_tokens: int = 0           # ... of them taken
    spec_emitted_tokens: int = 0            # tokens the verify steps produced (the accepted ones + one each)
    spec_verify_steps: int = 0              # request-steps that checked a proposal
    spec_acceptance_rate: float = 0.0       # accepted / draft
    spec_skipped: str = ""                  # requests that ran without speculation, by reason: "reason=count, ..."

    @property
    def pending_request(self) -> int:
        return self.pendding_request

    def dict(self) -> dict:
        return asdict(self)

    def ToString(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dict().items())


@dataclass(frozen=True)
class RequestHandle:
    """Identifies one request of one model; returned by start_request, passed back to the engine."""
    model_name: str
    request_id: int
