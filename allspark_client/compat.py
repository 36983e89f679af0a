"""DashInfer calls kept for code ported from it: the deprecated ResultQueue shortcuts (`get_no_wait`,
`get_wait`, `get_request_status`) and `build_model_from_config_struct`, v1's `get_output_*`, `reset_stream` and
`save_model`, `get_free_frame`, `get_file_information`, `get_op_profiling_info` (the table of `get_op_profile`),
`dump_build_meta_to_proto` and `serialize_model_from_torch` (which converts in this process with the converter
allspark_server registers here when imported: it needs torch). A mixin of EngineAPI, so Engine and ClientEngine
answer them alike. Torch-free.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import struct
import warnings
from typing import Callable, NamedTuple, Optional

from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsException, AsStatus, GeneratedElements, GenerateRequestStatus, RequestHandle
from allspark_client.version import __version__

HASH_BYTES = 32 << 20                   # build_meta.weight_hash: md5 of the weights file's first 32 MiB (DashInfer's)


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
    def refuse(why: str) -> AsException:
        return AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"{param_path!r} is not an allspark .asparam file: {why}")

    with open(param_path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise refuse("it is shorter than the 8 bytes that give its header's size")
        (size,) = struct.unpack("<Q", head)
        if size > os.path.getsize(param_path) - 8:
            raise refuse(f"its header's size ({size} bytes) runs past the end of the file")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise refuse(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise refuse(f"its header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise refuse(f"its header's __metadata__ is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != "allspark":
        raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                          f"{param_path!r} is a safetensors file but not an allspark .asparam file")
    return str(meta.get("allspark_version", ""))


def file_information(graph_path: str, param_path: str) -> AsFileInfo:
    from google.protobuf.message import DecodeError

    from allspark_client._proto import allspark_pb2 as pb
    for what, p in (("graph_path", graph_path), ("param_path", param_path)):
        if not isinstance(p, (str, os.PathLike)):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"get_file_information: {what} must be a path, got "
                                                             f"{type(p).__name__}")
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
        and the share of the step time (op_profile_report.py); with profiling off, the message that says how
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
        K or V cache, so a free span of ours (every layer's K and V) is 2 x layers frames. 0 while the model is
        asleep (unload_device_mem): its KV cache is freed, so no frame can be taken until load_device_mem."""
        layers = json.loads(self.get_model_info(name))["args"]["num_layers"]
        stat = self.get_as_engine_stat(name)
        return 0 if stat.asleep else stat.free_span * 2 * layers

    def get_file_information(self, graph_path: str, param_path: str) -> AsFileInfo:
        """The versions that wrote a model's .asgraph and .asparam, and this engine's (read here, not by a pool).
        Refused (INVALID_CALL_ERROR) after shutdown() / close(), as every other call."""
        if getattr(self, "_closed", False):
            raise AsException(AsStatus.ALLSPARK_INVALID_CALL_ERROR,
                              f"this {type(self).__name__} is shut down: shutdown() or close() was called")
        return file_information(graph_path, param_path)

    # ---- DashInfer v1 calls --------------------------------------------------------------------------------
    def install_model(self, cfg) -> AsStatus:
        raise NotImplementedError

    def stop_request(self, name: str, handle: RequestHandle) -> AsStatus:
        raise NotImplementedError

    def get_version_full(self) -> str:
        raise NotImplementedError

    def _model_handles(self, name: str) -> list[RequestHandle]:
        """The live requests of model `name` this engine (client) holds; AsException for an unknown model."""
        raise NotImplementedError

    def _save_model(self, name: str, saved_dir: str, with_weight: bool) -> AsStatus:
        raise NotImplementedError

    def build_model_from_config_struct(self, cfg) -> AsStatus:
        """Deprecated (as in DashInfer): install_model."""
        _deprecated("build_model_from_config_struct", "install_model(cfg)")
        return self.install_model(cfg)

    def get_output_no_wait(self, name: str, queue: ResultQueue) -> Optional[GeneratedElements]:
        """v1: the new output now, ids and logprobs (`ResultQueue.GetNoWait`); None when there is none."""
        return _queue(queue).GetNoWait()

    def get_output_wait(self, name: str, queue: ResultQueue) -> Optional[GeneratedElements]:
        """v1: the new output, waiting for some (`ResultQueue.Get`); None once the request ended and all was read."""
        return _queue(queue).Get()

    def reset_stream(self, model_name: str, **kwargs) -> AsStatus:
        """v1: stop every request of the model that this engine (a ClientEngine: this client) holds, as stop_request
        does, so no stream of it produces more; the handles stay valid until released."""
        if kwargs:
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, f"reset_stream takes no options, got {sorted(kwargs)}")
        try:
            handles = self._model_handles(model_name)
        except AsException as e:
            return self._fail(e.status, e.message)
        for handle in handles:
            status = self.stop_request(model_name, handle)
            if status not in (AsStatus.ALLSPARK_SUCCESS, AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID):   # or released now
                return status
        return AsStatus.ALLSPARK_SUCCESS

    def save_model(self, model_name: str, saved_dir: str, with_weight: bool = True,
                   is_text_graph: bool = False) -> AsStatus:
        """v1: write the installed model's files again, `<saved_dir>/<model_name>.asgraph` (+ `.asparam` with
        `with_weight`), where the engine runs (a pool: on rank 0's machine; a relative dir is this process's)."""
        if is_text_graph:
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, "save_model: is_text_graph=True is not supported: "
                                                             "allspark reads binary .asgraph files only")
        if not isinstance(saved_dir, (str, os.PathLike)) or not str(saved_dir):
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, f"save_model: saved_dir must be a path, got {saved_dir!r}")
        return self._save_model(model_name, os.path.abspath(saved_dir), bool(with_weight))

    def dump_build_meta_to_proto(self, model_proto, weights_path: str, torch_build_param: dict):
        """Fill a ModelGraph's build_meta: this allspark's version and git sha, now, the md5 of the weights file's
        first 32 MiB, and `torch_build_param`'s scalar and list values as strings. Returns the proto."""
        from allspark_client._proto import allspark_pb2 as pb
        if not isinstance(model_proto, pb.ModelGraph):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"dump_build_meta_to_proto takes an allspark ModelGraph (the .asgraph protobuf), got "
                              f"{type(model_proto).__name__}")
        if not os.path.isfile(weights_path):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"weights file {weights_path!r} does not exist")
        meta = model_proto.build_meta
        meta.allspark_version = __version__
        sha = re.search(r"GitSha1:([^)]*)", self.get_version_full())
        meta.git_sha = sha.group(1) if sha else ""
        meta.build_time = datetime.datetime.now(datetime.timezone.utc).isoformat()
        with open(weights_path, "rb") as f:
            meta.weight_hash = hashlib.md5(f.read(HASH_BYTES)).hexdigest()
        for key, value in (torch_build_param or {}).items():
            if isinstance(value, (bool, int, float, str, list)):
                meta.serialize_args[str(key)] = str(value)
        return model_proto

    def serialize_model_from_torch(self, model_name, model_type, torch_model, model_config, save_dir=None,
                                   as_model_path=None, as_weight_path=None, data_type="float32",
                                   derive_type="lmhead", multigpu_mode=1, do_binary_add_fused=True,
                                   do_dynamic_quantize_convert=False, quant_config=None, enable_i8cache_mha=False,
                                   mha_kv_cache_config=None, use_dynamic_ntk=False, use_logn_attn=False,
                                   model_sequence_length=2048, seqlen_extrapolation=1.0, lora_cfg=None,
                                   rotary_base=10000.0) -> tuple[str, str]:
        """DashInfer's converter: a torch state dict and its HF config dict (`model_type` in DashInfer's tags or our
        architecture names) -> `<save_dir>/<model_name>.asgraph` + `.asparam` (or the two paths given), the files
        HuggingFaceModel.serialize writes. Runs in this process (a ClientEngine's too: it needs torch here); bad or
        unsupported arguments raise ModelSerializerException naming them. Returns (graph path, weights path)."""
        args = dict(locals())
        del args["self"]
        return _torch_serializer()(**args)


# allspark_server puts its converter (loader/torch_state.py) here when it is imported: the client never imports the
# server, the tie runs from the server down to this slot
TORCH_SERIALIZER: Optional[Callable] = None


def _torch_serializer() -> Callable:
    if TORCH_SERIALIZER is None:
        raise AsException(AsStatus.ALLSPARK_RUNTIME_ERROR,
                          "serialize_model_from_torch converts the weights in this process with allspark_server's "
                          "loader, which needs torch: `import allspark_server` first (with torch installed), or "
                          "serialize where it is installed and install the files")
    return TORCH_SERIALIZER
