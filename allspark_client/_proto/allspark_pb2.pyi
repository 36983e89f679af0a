from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SplitMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_REPLICATE: _ClassVar[SplitMode]
    SPLIT_COLUMN: _ClassVar[SplitMode]
    SPLIT_ROW: _ClassVar[SplitMode]
    SPLIT_HEADS: _ClassVar[SplitMode]
    SPLIT_KV_HEADS: _ClassVar[SplitMode]
    SPLIT_VOCAB: _ClassVar[SplitMode]
    SPLIT_ROW_HEADS: _ClassVar[SplitMode]
SPLIT_REPLICATE: SplitMode
SPLIT_COLUMN: SplitMode
SPLIT_ROW: SplitMode
SPLIT_HEADS: SplitMode
SPLIT_KV_HEADS: SplitMode
SPLIT_VOCAB: SplitMode
SPLIT_ROW_HEADS: SplitMode

class TensorInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "split_mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    split_mode: SplitMode
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., split_mode: _Optional[_Union[SplitMode, str]] = ...) -> None: ...

class BuildMeta(_message.Message):
    __slots__ = ("allspark_version", "git_sha", "build_time", "weight_hash", "serialize_args")
    class SerializeArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ALLSPARK_VERSION_FIELD_NUMBER: _ClassVar[int]
    GIT_SHA_FIELD_NUMBER: _ClassVar[int]
    BUILD_TIME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_HASH_FIELD_NUMBER: _ClassVar[int]
    SERIALIZE_ARGS_FIELD_NUMBER: _ClassVar[int]
    allspark_version: str
    git_sha: str
    build_time: str
    weight_hash: str
    serialize_args: _containers.ScalarMap[str, str]
    def __init__(self, allspark_version: _Optional[str] = ..., git_sha: _Optional[str] = ..., build_time: _Optional[str] = ..., weight_hash: _Optional[str] = ..., serialize_args: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("eos_token_ids", "stop_token_ids", "context_length")
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    def __init__(self, eos_token_ids: _Optional[_Iterable[int]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ...) -> None: ...

class ModelGraph(_message.Message):
    __slots__ = ("format_version", "model_name", "architecture", "model_args_json", "hf_config_json", "dtype", "quantization", "tensors", "build_meta", "generation", "tokenizer_json")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    HF_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUILD_META_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    model_name: str
    architecture: str
    model_args_json: str
    hf_config_json: str
    dtype: str
    quantization: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    build_meta: BuildMeta
    generation: GenerationDefaults
    tokenizer_json: str
    def __init__(self, format_version: _Optional[int] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., model_args_json: _Optional[str] = ..., hf_config_json: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., build_meta: _Optional[_Union[BuildMeta, _Mapping]] = ..., generation: _Optional[_Union[GenerationDefaults, _Mapping]] = ..., tokenizer_json: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "protocol_version", "version_full", "world_size", "pid")
    READY_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FULL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    protocol_version: int
    version_full: str
    world_size: int
    pid: int
    def __init__(self, ready: _Optional[bool] = ..., protocol_version: _Optional[int] = ..., version_full: _Optional[str] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("status", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("model_name", "force")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    force: bool
    def __init__(self, model_name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("release_after_s",)
    RELEASE_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    release_after_s: float
    def __init__(self, release_after_s: _Optional[float] = ...) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("model_name", "request_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    request_id: int
    def __init__(self, model_name: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class SyncRequestMsg(_message.Message):
    __slots__ = ("model_name", "request_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    request_id: int
    def __init__(self, model_name: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class TextReply(_message.Message):
    __slots__ = ("status", "message", "text")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    text: str
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class DeviceMemRequest(_message.Message):
    __slots__ = ("model_name", "wake_from")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WAKE_FROM_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    wake_from: str
    def __init__(self, model_name: _Optional[str] = ..., wake_from: _Optional[str] = ...) -> None: ...

class SaveModelRequest(_message.Message):
    __slots__ = ("model_name", "saved_dir", "with_weight")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SAVED_DIR_FIELD_NUMBER: _ClassVar[int]
    WITH_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    saved_dir: str
    with_weight: bool
    def __init__(self, model_name: _Optional[str] = ..., saved_dir: _Optional[str] = ..., with_weight: _Optional[bool] = ...) -> None: ...

class LoraRequest(_message.Message):
    __slots__ = ("model_name", "lora_name", "path")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    lora_name: str
    path: str
    def __init__(self, model_name: _Optional[str] = ..., lora_name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraList(_message.Message):
    __slots__ = ("status", "message", "lora_names")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class RuntimeConfig(_message.Message):
    __slots__ = ("model_name", "model_path", "weights_path", "compute_unit", "engine_max_length", "engine_max_batch", "engine_max_prefill_length", "num_threads", "matmul_precision", "cache_mode", "cache_span_size", "kv_cache_memory_bytes", "enable_prefix_cache", "prefix_cache_ttl", "prefix_cache_host_bytes", "enable_profiling", "speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "draft_model", "draft_dtype", "draft_quantize", "speculative_max_batch", "lora_max_num", "lora_max_rank", "speculative_rows")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UNIT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_PREFILL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    MATMUL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPAN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TTL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PROFILING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    LORA_MAX_NUM_FIELD_NUMBER: _ClassVar[int]
    LORA_MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_path: str
    weights_path: str
    compute_unit: str
    engine_max_length: int
    engine_max_batch: int
    engine_max_prefill_length: int
    num_threads: int
    matmul_precision: str
    cache_mode: int
    cache_span_size: int
    kv_cache_memory_bytes: int
    enable_prefix_cache: bool
    prefix_cache_ttl: int
    prefix_cache_host_bytes: int
    enable_profiling: bool
    speculative_method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    draft_model: str
    draft_dtype: str
    draft_quantize: str
    speculative_max_batch: int
    lora_max_num: int
    lora_max_rank: int
    speculative_rows: str
    def __init__(self, model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., weights_path: _Optional[str] = ..., compute_unit: _Optional[str] = ..., engine_max_length: _Optional[int] = ..., engine_max_batch: _Optional[int] = ..., engine_max_prefill_length: _Optional[int] = ..., num_threads: _Optional[int] = ..., matmul_precision: _Optional[str] = ..., cache_mode: _Optional[int] = ..., cache_span_size: _Optional[int] = ..., kv_cache_memory_bytes: _Optional[int] = ..., enable_prefix_cache: _Optional[bool] = ..., prefix_cache_ttl: _Optional[int] = ..., prefix_cache_host_bytes: _Optional[int] = ..., enable_profiling: _Optional[bool] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., draft_model: _Optional[str] = ..., draft_dtype: _Optional[str] = ..., draft_quantize: _Optional[str] = ..., speculative_max_batch: _Optional[int] = ..., lora_max_num: _Optional[int] = ..., lora_max_rank: _Optional[int] = ..., speculative_rows: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationConfig(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_length", "max_length", "max_new_tokens", "has_eos_token_id", "eos_token_id", "stop_words_ids", "seed", "logprobs", "top_logprobs", "do_sample", "response_format_json", "speculative", "lora_name", "logit_bias", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_WORDS_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_JSON_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_length: int
    max_length: int
    max_new_tokens: int
    has_eos_token_id: bool
    eos_token_id: _containers.RepeatedScalarFieldContainer[int]
    stop_words_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    seed: int
    logprobs: bool
    top_logprobs: int
    do_sample: bool
    response_format_json: str
    speculative: bool
    lora_name: str
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_length: _Optional[int] = ..., max_length: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., has_eos_token_id: _Optional[bool] = ..., eos_token_id: _Optional[_Iterable[int]] = ..., stop_words_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., do_sample: _Optional[bool] = ..., response_format_json: _Optional[str] = ..., speculative: _Optional[bool] = ..., lora_name: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model_name", "input_ids", "config", "session_id", "images")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    config: GenerationConfig
    session_id: str
    images: PromptImageInputs
    def __init__(self, model_name: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., config: _Optional[_Union[GenerationConfig, _Mapping]] = ..., session_id: _Optional[str] = ..., images: _Optional[_Union[PromptImageInputs, _Mapping]] = ...) -> None: ...

class PromptImageInputs(_message.Message):
    __slots__ = ("pixel_values", "patch_dim", "image_grid_thw")
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    PATCH_DIM_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    pixel_values: bytes
    patch_dim: int
    image_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pixel_values: _Optional[bytes] = ..., patch_dim: _Optional[int] = ..., image_grid_thw: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("arrival_time", "first_token_time", "last_token_time", "finished_time", "time_to_first_token", "time_in_queue", "context_token_length", "generated_token_length", "context_cached_length", "context_tps", "generate_tps")
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TIME_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIME_IN_QUEUE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TPS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_TPS_FIELD_NUMBER: _ClassVar[int]
    arrival_time: int
    first_token_time: int
    last_token_time: int
    finished_time: int
    time_to_first_token: int
    time_in_queue: int
    context_token_length: int
    generated_token_length: int
    context_cached_length: int
    context_tps: float
    generate_tps: float
    def __init__(self, arrival_time: _Optional[int] = ..., first_token_time: _Optional[int] = ..., last_token_time: _Optional[int] = ..., finished_time: _Optional[int] = ..., time_to_first_token: _Optional[int] = ..., time_in_queue: _Optional[int] = ..., context_token_length: _Optional[int] = ..., generated_token_length: _Optional[int] = ..., context_cached_length: _Optional[int] = ..., context_tps: _Optional[float] = ..., generate_tps: _Optional[float] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("status", "message", "request_id", "generate_status", "ids", "token_logprobs", "top_logprobs", "prefix_cache_len", "stats", "has_prompt_logprobs", "prompt_token_logprobs", "prompt_top_logprobs")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_STATUS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    request_id: int
    generate_status: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prefix_cache_len: int
    stats: RequestStats
    has_prompt_logprobs: bool
    prompt_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., request_id: _Optional[int] = ..., generate_status: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prefix_cache_len: _Optional[int] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_token_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model_name", "inputs", "pooling", "normalize")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    inputs: _containers.RepeatedCompositeFieldContainer[TokenIds]
    pooling: str
    normalize: bool
    def __init__(self, model_name: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ...) -> None: ...

class EmbedReply(_message.Message):
    __slots__ = ("status", "message", "dim", "data")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    dim: int
    data: bytes
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class EngineStat(_message.Message):
    __slots__ = ("status", "message", "model_name", "free_token", "total_token", "pendding_request", "running_request", "total_generated_token", "total_prefill_token", "generate_token_persec", "process_token_persec", "total_span", "used_span", "free_span", "span_size", "token_usage_percentage", "num_preempted", "prefix_cache_hit_token", "prefix_cache_miss_token", "prefix_cache_hit_rate", "prefix_cache_miss_rate", "prefix_cache_spans", "prefix_cache_host_spans", "memory_bandwidth_gbs", "memory_bandwidth_utilization", "rank_memory_bandwidth_gbs", "rank_memory_bandwidth_utilization", "asleep", "spec_draft_tokens", "spec_accepted_tokens", "spec_emitted_tokens", "spec_verify_steps", "spec_acceptance_rate", "spec_skipped")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PENDDING_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GENERATED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PREFILL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATE_TOKEN_PERSEC_FIELD_NUMBER: _ClassVar[int]
    PROCESS_TOKEN_PERSEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SPAN_FIELD_NUMBER: _ClassVar[int]
    USED_SPAN_FIELD_NUMBER: _ClassVar[int]
    FREE_SPAN_FIELD_NUMBER: _ClassVar[int]
    SPAN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SPANS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_SPANS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_GBS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    RANK_MEMORY_BANDWIDTH_GBS_FIELD_NUMBER: _ClassVar[int]
    RANK_MEMORY_BANDWIDTH_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    model_name: str
    free_token: int
    total_token: int
    pendding_request: int
    running_request: int
    total_generated_token: int
    total_prefill_token: int
    generate_token_persec: float
    process_token_persec: float
    total_span: int
    used_span: int
    free_span: int
    span_size: int
    token_usage_percentage: float
    num_preempted: int
    prefix_cache_hit_token: int
    prefix_cache_miss_token: int
    prefix_cache_hit_rate: float
    prefix_cache_miss_rate: float
    prefix_cache_spans: int
    prefix_cache_host_spans: int
    memory_bandwidth_gbs: float
    memory_bandwidth_utilization: float
    rank_memory_bandwidth_gbs: _containers.RepeatedScalarFieldContainer[float]
    rank_memory_bandwidth_utilization: _containers.RepeatedScalarFieldContainer[float]
    asleep: bool
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_emitted_tokens: int
    spec_verify_steps: int
    spec_acceptance_rate: float
    spec_skipped: str
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., model_name: _Optional[str] = ..., free_token: _Optional[int] = ..., total_token: _Optional[int] = ..., pendding_request: _Optional[int] = ..., running_request: _Optional[int] = ..., total_generated_token: _Optional[int] = ..., total_prefill_token: _Optional[int] = ..., generate_token_persec: _Optional[float] = ..., process_token_persec: _Optional[float] = ..., total_span: _Optional[int] = ..., used_span: _Optional[int] = ..., free_span: _Optional[int] = ..., span_size: _Optional[int] = ..., token_usage_percentage: _Optional[float] = ..., num_preempted: _Optional[int] = ..., prefix_cache_hit_token: _Optional[int] = ..., prefix_cache_miss_token: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_miss_rate: _Optional[float] = ..., prefix_cache_spans: _Optional[int] = ..., prefix_cache_host_spans: _Optional[int] = ..., memory_bandwidth_gbs: _Optional[float] = ..., memory_bandwidth_utilization: _Optional[float] = ..., rank_memory_bandwidth_gbs: _Optional[_Iterable[float]] = ..., rank_memory_bandwidth_utilization: _Optional[_Iterable[float]] = ..., asleep: _Optional[bool] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_emitted_tokens: _Optional[int] = ..., spec_verify_steps: _Optional[int] = ..., spec_acceptance_rate: _Optional[float] = ..., spec_skipped: _Optional[str] = ...) -> None: ...

class OpTiming(_message.Message):
    __slots__ = ("rank", "op", "count", "min_ms", "max_ms", "sum_ms")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MIN_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    SUM_MS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    op: str
    count: int
    min_ms: float
    max_ms: float
    sum_ms: float
    def __init__(self, rank: _Optional[int] = ..., op: _Optional[str] = ..., count: _Optional[int] = ..., min_ms: _Optional[float] = ..., max_ms: _Optional[float] = ..., sum_ms: _Optional[float] = ...) -> None: ...

class RankSteps(_message.Message):
    __slots__ = ("rank", "steps", "step_ms")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    steps: int
    step_ms: float
    def __init__(self, rank: _Optional[int] = ..., steps: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class OpProfile(_message.Message):
    __slots__ = ("status", "message", "model_name", "enabled", "ops", "steps", "clock")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    model_name: str
    enabled: bool
    ops: _containers.RepeatedCompositeFieldContainer[OpTiming]
    steps: _containers.RepeatedCompositeFieldContainer[RankSteps]
    clock: str
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., model_name: _Optional[str] = ..., enabled: _Optional[bool] = ..., ops: _Optional[_Iterable[_Union[OpTiming, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[RankSteps, _Mapping]]] = ..., clock: _Optional[str] = ...) -> None: ...
