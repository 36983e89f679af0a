"""The pool's gRPC service on rank 0: each RPC is a thin call into the Engine.

Owns request/reply translation only; validation and all state live in the Engine. Generate is a
server stream fed from the request's ResultQueue: a reply per batch of new tokens, then a last
reply with the terminal status and stats. A client that goes away mid-stream has its request
released; otherwise the client releases it (ReleaseRequest), as with Engine.
"""
from __future__ import annotations

import logging
import os
from concurrent import futures

import grpc

from allspark_client import convert
from allspark_client._proto import allspark_pb2 as pb
from allspark_client._proto import allspark_pb2_grpc as pb_grpc
from allspark_client.validation import ConfigError
from allspark_client.types import AsException, AsStatus, RequestHandle
from allspark_server.engine import Engine
from allspark_server.version import version_full

log = logging.getLogger(__name__)
STREAM_POLL_MS = 200          # how often a stream checks that its client is still there
MAX_MESSAGE_BYTES = 64 << 20


class AllsparkServicer(pb_grpc.AllsparkServicer):
    def __init__(self, engine: Engine, world_size: int):
        self.engine = engine
        self.world_size = world_size
        self.ready = False

    def _status(self, status: AsStatus) -> pb.StatusReply:
        return pb.StatusReply(status=int(status), message="" if status == 0 else self.engine.get_last_error())

    def Health(self, request, context):
        return pb.HealthReply(ready=self.ready, protocol_version=convert.PROTOCOL_VERSION,
                              version_full=version_full(), world_size=self.world_size, pid=os.getpid())

    def InstallModel(self, request, context):
        try:
            cfg = convert.runtime_config_from_proto(request)
            return self._status(self.engine.install_model(cfg))
        except ConfigError as e:
            return pb.StatusReply(status=int(e.status), message=str(e))
        except AsException as e:
            return pb.StatusReply(status=int(e.status), message=e.message)

    def StartModel(self, request, context):
        return self._status(self.engine.start_model(request.model_name))

    def StopModel(self, request, context):
        return self._status(self.engine.stop_model(request.model_name))

    def ReleaseModel(self, request, context):
        return self._status(self.engine.release_model(request.model_name))

    def Generate(self, request, context):
        gen = convert.generation_config_from_proto(request.config)
        status, handle, queue = self.engine.start_request(request.model_name, {"input_ids": list(request.input_ids)},
                                                          gen)
        if status != AsStatus.ALLSPARK_SUCCESS:
            yield pb.GenerateReply(status=int(status), message=self.engine.get_last_error())
            return
        delivered = []   # set once the last reply is out: the client owns the release from then on
        context.add_callback(lambda: None if delivered else self._release_if_live(handle))
        yield pb.GenerateReply(status=0, request_id=handle.request_id, generate_status=int(queue.GenerateStatus()))
        while True:
            el = queue.GetWithTimeout(STREAM_POLL_MS)
            if not context.is_active():
                return
            gen_status = queue.GenerateStatus()
            if el is None and not gen_status.is_terminal:
                continue
            reply = pb.GenerateReply(status=0, request_id=handle.request_id, generate_status=int(gen_status))
            if el is not None:
                convert.elements_to_reply(el, reply)
                yield reply
                continue
            # terminal and drained: the last reply carries the reason (if any) and the stats
            reply.message = queue.ErrorMessage() or ""
            reply.stats.CopyFrom(convert.stats_to_proto(queue.RequestStatInfo()))
            yield reply
            delivered.append(True)
            return

    def _release_if_live(self, handle: RequestHandle) -> None:
        """The stream was cancelled before its end (the client went away): nobody can read or release
        this request any more, so release it here."""
        if self.engine.has_request(handle.model_name, handle):
            self.engine.release_request(handle.model_name, handle)

    def StopRequest(self, request, context):
        return self._status(self.engine.stop_request(request.model_name,
                                                     RequestHandle(request.model_name, request.request_id)))

    def ReleaseRequest(self, request, context):
        return self._status(self.engine.release_request(request.model_name,
                                                        RequestHandle(request.model_name, request.request_id)))

    def SyncRequest(self, request, context):
        handle = RequestHandle(request.model_name, request.request_id) if request.HasField("request_id") else None
        return self._status(self.engine.sync_request(request.model_name, handle))

    def GetModelInfo(self, request, context):
        try:
            return pb.TextReply(status=0, text=self.engine.get_model_info(request.model_name))
        except AsException as e:
            return pb.TextReply(status=int(e.status), message=e.message)

    def GetEngineStat(self, request, context):
        try:
            return convert.engine_stat_to_proto(self.engine.get_as_engine_stat(request.model_name))
        except AsException as e:
            return pb.EngineStat(status=int(e.status), message=e.message)


def start_server(servicer: AllsparkServicer, address: str, max_workers: int) -> grpc.Server:
    """Bind `address` ('unix:/path' or 'host:port') and start serving."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="allspark-grpc"),
                         options=options, maximum_concurrent_rpcs=max_workers)
    pb_grpc.add_AllsparkServicer_to_server(servicer, server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind gRPC address {address!r}")
    server.start()
    return server
