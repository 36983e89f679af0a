"""allspark_server: the in-process Engine, the model loader, the pool rank (`python -m allspark_server`) and the
OpenAI-compatible server (allspark_server.http)."""
from allspark_client import (
                             AsCacheMode,
                             AsEngineStat,
                             AsException,
                             AsStatus,
                             GeneratedElements,
                             GenerateRequestStatus,
                             RequestHandle,
                             RequestStatInfo,
                             ResultQueue,
                             TargetDevice,
)
from allspark_client import compat as _compat
from allspark_client.config import ASGenerationConfigBuilder, AsModelConfig, AsModelRuntimeConfigBuilder, ConfigError
from allspark_server.engine.engine import Engine
from allspark_server.loader.hf_model import HuggingFaceModel, ModelSerializerException
from allspark_server.loader.torch_state import serialize_model_from_torch as _serialize_model_from_torch

_compat.TORCH_SERIALIZER = _serialize_model_from_torch     # ClientEngine.serialize_model_from_torch converts here

__all__ = ["AsCacheMode", "AsEngineStat", "AsException", "AsModelConfig", "AsModelRuntimeConfigBuilder",
           "ASGenerationConfigBuilder", "AsStatus", "ConfigError", "Engine", "GeneratedElements",
           "GenerateRequestStatus", "HuggingFaceModel", "ModelSerializerException", "RequestHandle",
           "RequestStatInfo", "ResultQueue", "TargetDevice"]
