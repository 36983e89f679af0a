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
SPLIT_REPLICATE: SplitMode
SPLIT_COLUMN: SplitMode
SPLIT_ROW: SplitMode
SPLIT_HEADS: SplitMode
SPLIT_KV_HEADS: SplitMode
SPLIT_VOCAB: SplitMode

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
    __slots__ = ("format_version", "model_name", "architecture", "model_args_json", "hf_config_json", "dtype", "quantization", "tensors", "build_meta", "generation")
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
    def __init__(self, format_version: _Optional[int] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., model_args_json: _Optional[str] = ..., hf_config_json: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., build_meta: _Optional[_Union[BuildMeta, _Mapping]] = ..., generation: _Optional[_Union[GenerationDefaults, _Mapping]] = ...) -> None: ...
