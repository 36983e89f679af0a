"""allspark_client: the torch-free public surface of allspark (types, ResultQueue; ClientEngine later)."""
from allspark_client.result_queue import ResultQueue
from allspark_client.types import (AsCacheMode, AsEngineStat, AsException, AsStatus, GeneratedElements,
                                   RequestHandle,
                                   GenerateRequestStatus, RequestStatInfo, TargetDevice)

__all__ = ["AsCacheMode", "AsEngineStat", "AsException", "AsStatus", "GeneratedElements",
           "GenerateRequestStatus", "RequestHandle", "RequestStatInfo", "ResultQueue", "TargetDevice"]
__version__ = "0.1.0"
