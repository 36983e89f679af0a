"""allspark_client: the torch-free public surface of allspark: types, configs, ResultQueue, ClientEngine."""
from allspark_client.compat import AsFileInfo
from allspark_client.config import AsModelConfig, AsModelRuntimeConfigBuilder
from allspark_client.generation_config import ASGenerationConfigBuilder
from allspark_client.result_queue import ResultQueue
from allspark_client.types import (
    AsCacheMode,
    AsEngineStat,
    AsException,
    AsStatus,
    GeneratedElements,
    GenerateRequestStatus,
    RequestHandle,
    RequestStatInfo,
    TargetDevice,
)
from allspark_client.version import __version__  # noqa: F401 (the package's version)

__all__ = ["ASGenerationConfigBuilder", "AsCacheMode", "AsEngineStat", "AsException", "AsFileInfo", "AsModelConfig",
           "AsModelRuntimeConfigBuilder", "AsStatus", "GeneratedElements",
           "GenerateRequestStatus", "RequestHandle", "RequestStatInfo", "ResultQueue", "TargetDevice"]


def __getattr__(name):   # ClientEngine pulls in grpc: import it only when asked for
    if name in ("ClientEngine", "PoolUnavailable", "PoolAccessDenied"):
        from allspark_client import client
        return getattr(client, name)
    raise AttributeError(name)
