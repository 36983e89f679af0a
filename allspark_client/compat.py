"""DashInfer calls kept for code ported from it: the deprecated ResultQueue shortcuts (`get_no_wait`,
`get_wait`, `get_request_status`), `get_free_frame`, `get_file_information` and `get_op_profiling_info` (the
table of `get_op_profile`). A mixin of EngineAPI, so Engine and ClientEngine answer them alike. Torch-free.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from typing import NamedTuple, Optional

from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsException, AsStatus, GenerateRequestStatus


class AsFileInfo(NamedTuple):
    """The allspark versions that wrote a model's two files, and this engine's version (DashInfer's fields)."""
    create_version_graph: str
    create_version_param: str
    current_version_engine: str


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated (as in DashInfer); use {new} instead", DeprecationWarning, stacklevel=3)


def _queue(queue) -> ResultQueue:
    if not isinstance(queue, ResultQueue):
        raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                          f"expected the ResultQueue start_request returned, got {type(queue).__name__}")
    return queue


def _param_version(param_path: str) -> str:
    """The allspark version in a .asparam (safetensors) header's metadata; '' for files that carry none."""
    with open(param_path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"{param_path!r} is not an allspark .asparam file")
        (size,) = struct.unpack("<Q", head)
        if size > os.path.getsize(param_path) - 8:
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"{param_path!r} is not an allspark .asparam file")
        try:
            meta = json.loads(f.read(size)).get("__metadata__") or {}
        except ValueError as e:
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"{param_path!r} is not an allspark .asparam file: {e}") from None
    if meta.get("format") != "allspark":
        raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                          f"{param_path!r} is a safetensors file but not an allspark .asparam file")
    return str(meta.get("allspark_version", ""))


def file_information(graph_path: str, param_path: str) -> AsFileInfo:
    from google.protobuf.message import DecodeError

    from allspark_client import __version__
    from allspark_client._proto import allspark_pb2 as pb
    for p in (graph_path, param_path):
        if not os.path.isfile(p):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"model file {p!r} does not exist")
    g = pb.ModelGraph()
    try:
        with open(graph_path, "rb") as f:
            g.ParseFromString(f.read())
    except DecodeError as e:
        raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                          f"{graph_path!r} is not an allspark .asgraph file: {e}") from None
    return AsFileInfo(g.build_meta.allspark_version, _param_version(param_path), __version__)


class DashInferCompat:
    def get_as_engine_stat(self, name: str):
        raise NotImplementedError

    def get_model_info(self, name: str) -> str:
        raise NotImplementedError

    def get_op_profile(self, name: str):
        raise NotImplementedError

    def get_op_profiling_info(self, name: str) -> str:
        """DashInfer's op table of model `name`: per rank and op, count and min / max / average / total milliseconds
        and the share of the step time (allspark_client/op_profile.py); with profiling off, the message that says how
        to turn it on. AsException (PARAM_ERROR) for a model that is not installed."""
        return self.get_op_profile(name).table()

    def get_no_wait(self, name: str, queue: ResultQueue) -> Optional[list[int]]:
        """Deprecated: the new token ids now (`ResultQueue.GetNoWait`), None when there are none."""
        _deprecated("get_no_wait", "ResultQueue.GetNoWait()")
        elements = _queue(queue).GetNoWait()
        return None if elements is None else list(elements.ids_from_generate)

    def get_wait(self, name: str, queue: ResultQueue) -> Optional[list[int]]:
        """Deprecated: the new token ids, waiting for some (`ResultQueue.Get`); None once the request ended."""
        _deprecated("get_wait", "ResultQueue.Get()")
        elements = _queue(queue).Get()
        return None if elements is None else list(elements.ids_from_generate)

    def get_request_status(self, name: str, queue: ResultQueue) -> GenerateRequestStatus:
        """Deprecated: `ResultQueue.GenerateStatus()`."""
        _deprecated("get_request_status", "ResultQueue.GenerateStatus()")
        return _queue(queue).GenerateStatus()

    def get_free_frame(self, name: str) -> int:
        """Free KV-cache frames of model `name`. A DashInfer frame is one span (span_size tokens) of one layer's
        K or V cache, so a free span of ours (every layer's K and V) is 2 x layers frames."""
        layers = json.loads(self.get_model_info(name))["args"]["num_layers"]
        return self.get_as_engine_stat(name).free_span * 2 * layers

    def get_file_information(self, graph_path: str, param_path: str) -> AsFileInfo:
        """The versions that wrote a model's .asgraph and .asparam, and this engine's (read here, not by a pool)."""
        return file_information(graph_path, param_path)
