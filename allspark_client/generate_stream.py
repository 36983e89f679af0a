"""A pool's Generate stream read into a ResultQueue (ClientEngine's reader thread per request): each reply's tokens,
logprobs and stats pushed as they come, the terminal status with its message last; a stream that breaks or ends
without a final status becomes an InternalError whose wording says whether the pool dropped the stream or is lost
(types.pool_failed recognizes the latter)."""
from __future__ import annotations

import grpc

from allspark_client import wire
from allspark_client.result_queue import ResultQueue
from allspark_client.types import GenerateRequestStatus


def read_generate_stream(call, queue: ResultQueue, address: str) -> None:
    try:
        for reply in call:
            status = GenerateRequestStatus(reply.generate_status)
            if reply.HasField("stats"):
                queue._set_stats(wire.stats_from_proto(reply.stats))
            el = wire.elements_from_reply(reply)
            if el.ids_from_generate:   # a last reply's tokens go in before its terminal status and message
                queue._push(el, GenerateRequestStatus.Generating if status.is_terminal else status)
            if status.is_terminal:
                queue._set_status(status, reply.message or None)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and queue.GenerateStatus().is_terminal:
            return
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:     # the pool is fine; it dropped this stream
            queue._set_status(GenerateRequestStatus.InternalError,
                              f"the pool at {address} dropped the stream: {e.details()}")
        else:   # this wording and the one below are what types.pool_failed (LOST_POOL) recognizes
            queue._set_status(GenerateRequestStatus.InternalError,
                              f"lost the pool at {address}: {e.code().name}: {e.details()}")
        return
    if not queue.GenerateStatus().is_terminal:   # the stream ended without a final status
        queue._set_status(GenerateRequestStatus.InternalError, f"the pool at {address} closed the stream")
