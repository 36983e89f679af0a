"""ClientEngine: the Engine API over gRPC to a pool (connect to an address, or spawn a pool).

Same methods and statuses as the in-process Engine. Requests are validated here first (same
rules, same messages), then sent as typed messages; each request's tokens arrive on a server
stream that a reader thread pushes into its ResultQueue — nothing polls. If the pool dies, open
queues end in InternalError and unary calls raise PoolUnavailable. Torch-free.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import grpc

from allspark_client import wire
from allspark_client._proto import allspark_pb2 as pb
from allspark_client._proto import allspark_pb2_grpc as pb_grpc
from allspark_client.api import EngineAPI, StartResult
from allspark_client.channel import RECONNECT_BACKOFF_MS, Pem, failure_reason, normalize_address, open_channel
from allspark_client.config import AsModelConfig
from allspark_client.embed_client import ClientEmbed
from allspark_client.generate_stream import read_generate_stream
from allspark_client.generation_config import parse_request
from allspark_client.image_inputs import request_images
from allspark_client.launch.spawned_pool import SpawnedPool
from allspark_client.lora_client import ClientLora
from allspark_client.op_profile_report import OpProfileReport
from allspark_client.result_queue import ResultQueue
from allspark_client.session import ClientSession
from allspark_client.sleep_wake import ClientDeviceMemory
from allspark_client.types import AsEngineStat, AsException, AsStatus, GenerateRequestStatus, RequestHandle, pool_failed
from allspark_client.validation import ConfigError

log = logging.getLogger("allspark.client")
STOP_WAIT_S = 30.0   # how long stop/release wait for the stream's final reply
START_TIMEOUT_S = 300.0   # default wait for a pool this client spawned, or one that answers that it is starting
CONNECT_TIMEOUT_S = 3.0   # an address given without start_timeout_s: its first answer may take this long
READY_POLL_S = 0.1        # between Health calls while a pool that answers is not ready yet
CLOSED = "this ClientEngine is closed: close() was called (a new ClientEngine can reach the pool again)"
RECONNECT_WAIT_S = 3 * RECONNECT_BACKOFF_MS / 1000


def _never_sent(e: grpc.RpcError) -> bool:
    """UNAVAILABLE before the call left this process (no connection): safe to send again."""
    return e.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (e.details() or "")


class PoolUnavailable(AsException):
    """The pool cannot be reached (not started, died, or shut down)."""


class PoolAccessDenied(PoolUnavailable):
    """The pool refused this client: a missing or wrong token, or a client certificate it does not accept."""


@dataclass
class _ClientRequest:
    handle: RequestHandle
    queue: ResultQueue
    call: Any                       # the Generate stream (cancellable)


class ClientEngine(ClientDeviceMemory, ClientLora, ClientEmbed, EngineAPI):
    _closed_reason = CLOSED      # what calls after close() are refused with (the mixins' too)

    def __init__(self, address: Optional[str] = None, *, ranks: Optional[int] = None,
                 numa_nodes: Optional[list[int]] = None, gpus: Optional[list[int] | str] = None,
                 launcher_args: tuple[str, ...] = (),
                 start_timeout_s: Optional[float] = None, token: Optional[str] = None, root_certificates: Pem = None,
                 certificate_chain: Pem = None, private_key: Pem = None):
        """Connect to a running pool at `address` ('unix:/path', '/path' or 'host:port'), or, without
        an address, spawn one with allspark-launch (`ranks`, `numa_nodes`; `gpus=[0, 1]` or "all": one rank per
        GPU, rank r seeing only the r-th, pinned to its NUMA node) and own it: it ends at close(), or with this
        process however that ends (launch/spawned_pool.py). An address nothing answers on fails
        at once with gRPC's reason; `start_timeout_s` (default 300 s) is how long a pool may take to be ready:
        one spawned, one that answers it is starting, and, only when given, one whose address does not answer yet.
        `token`: the pool's bearer token (default $ALLSPARK_TOKEN; a pool spawned on TCP gets this one, or one made
        for it: launch/spawned_pool.py); `root_certificates` (PEM bytes or a path):
        TLS, trusting that CA; `certificate_chain` + `private_key`: a client certificate (channel.py)."""
        self._pool: Optional[SpawnedPool] = None    # a pool this object spawned (and ends)
        self._session: Optional[ClientSession] = None
        self._closed = False
        if address is None:
            self._pool = SpawnedPool(ranks, numa_nodes, gpus, launcher_args, token)
            address = self._pool.address
            token = self._pool.token or token      # a TCP pool's token (the caller's, or one made for it)
        try:
            self.address = normalize_address(address)
            try:
                self._channel = open_channel(self.address, token, root_certificates, certificate_chain, private_key)
            except ValueError as e:
                raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, str(e)) from None
            self._tls = root_certificates is not None
            self._stub = pb_grpc.AllsparkStub(self._channel)
            self._live: dict[tuple[str, int], _ClientRequest] = {}
            self._lock = threading.Lock()
            self._errors = threading.local()
            self.health = self._wait_ready(start_timeout_s)
            try:   # the pool releases what this client leaves unreleased if it dies (session.py)
                self._session = ClientSession(self._stub, CONNECT_TIMEOUT_S)
            except grpc.RpcError as e:
                raise self._unavailable(e) from None
            weakref.finalize(self, self._session.close)    # dropped without close(): its session ends too
        except BaseException:
            # a pool spawned for this object that never became ready (it exited, or start_timeout_s passed) is not
            # left running without an owner, nor its directory behind
            self._end_spawned_pool()
            raise

    # ---- pool process ------------------------------------------------------------------------
    def _pool_output(self) -> str:
        return self._pool.output() if self._pool is not None else ""

    def _wait_ready(self, timeout_s: Optional[float]) -> pb.HealthReply:
        """Health calls until every rank serves, the pool dies, or timeout. They wait for a connection
        (wait_for_ready) for a pool this client spawned or when the caller gave timeout_s; otherwise an address
        that does not answer fails at once."""
        patient = self._pool is not None or timeout_s is not None
        timeout_s = START_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if self._pool is not None and self._pool.exit_code() is not None:
                raise PoolUnavailable(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                      f"the pool exited with code {self._pool.exit_code()} before it was ready:\n"
                                      f"{self._pool_output()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolUnavailable(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                      f"no ready pool at {self.address} after {timeout_s:.0f}s{self._why_not()}\n"
                                      f"{self._pool_output()}")
            try:
                reply = self._stub.Health(pb.HealthRequest(), wait_for_ready=patient,
                                          timeout=min(left, 2.0 if patient else CONNECT_TIMEOUT_S))
            except grpc.RpcError as e:
                unreachable = e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                if unreachable and patient:
                    continue
                if unreachable:
                    raise PoolUnavailable(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                          f"no pool answers at {self.address}: "
                                          f"{failure_reason(e, self.address, self._tls)}") from None
                raise self._unavailable(e) from None
            if reply.protocol_version != wire.PROTOCOL_VERSION:
                raise AsException(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                  f"pool speaks protocol {reply.protocol_version}, this client "
                                  f"{wire.PROTOCOL_VERSION}: upgrade one side")
            if reply.ready:
                return reply
            time.sleep(READY_POLL_S)

    def close(self) -> None:
        """Release this client's requests, close the connection; a pool this client spawned is shut
        down (SIGTERM to its launcher, then waited for). Idempotent. Afterwards every call is refused with
        ALLSPARK_INVALID_CALL_ERROR, returned by the calls that return a status, raised (AsException) by others."""
        if self._closed:
            return
        with self._lock:
            live = list(self._live.values())
        for r in live:
            try:
                self.release_request(r.handle.model_name, r.handle)
            except AsException:
                break   # the pool is gone
        self._closed = True
        if self._session is not None:
            self._session.close()
        self._channel.close()
        self._end_spawned_pool()

    def _end_spawned_pool(self) -> None:
        """A pool this client spawned: stopped (SIGTERM to its launcher, waited for), its directory removed."""
        if self._pool is not None:
            self._pool.end()

    # ---- plumbing ----------------------------------------------------------------------------
    def _why_not(self) -> str:
        """After a timeout: what one call without wait_for_ready says (a TLS mismatch shows here)."""
        try:
            self._stub.Health(pb.HealthRequest(), timeout=2.0)
        except grpc.RpcError as e:
            return f": {failure_reason(e, self.address, self._tls)}"
        return ""

    def _unavailable(self, e: grpc.RpcError) -> PoolUnavailable:
        """The error for a failed call; for a pool this client spawned, with the end of the pool's output
        (where a rank's traceback is)."""
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return PoolAccessDenied(AsStatus.ALLSPARK_REQUEST_DENIED,
                                    f"the pool at {self.address} refused this client: {e.code().name}: {e.details()}")
        output = self._pool_output()
        return PoolUnavailable(AsStatus.ALLSPARK_RUNTIME_ERROR,
                               f"pool at {self.address} is unavailable: {e.code().name}: {e.details()}"
                               + (f"\nthe pool's output ends with:\n{output}" if output else ""))

    def _rpc(self, method, request):
        if self._closed:
            raise AsException(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        try:
            return method(request)
        except grpc.RpcError as e:
            if not _never_sent(e):
                raise self._unavailable(e) from None
        try:   # the channel still remembers a pool that went away: wait one reconnect for one that came back
            self._stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=RECONNECT_WAIT_S)
            return method(request)
        except grpc.RpcError as e:
            raise self._unavailable(e) from None

    def _status(self, reply) -> AsStatus:
        if reply.status != 0:
            return self._fail(reply.status, reply.message)
        return AsStatus.ALLSPARK_SUCCESS

    # ---- model lifecycle ---------------------------------------------------------------------
    def install_model(self, cfg: AsModelConfig) -> AsStatus:
        if not isinstance(cfg, AsModelConfig):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"install_model takes an AsModelConfig, got {type(cfg).__name__}")
        reply = self._rpc(self._stub.InstallModel, wire.runtime_config_to_proto(cfg))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return AsStatus.ALLSPARK_SUCCESS

    def start_model(self, name: str) -> AsStatus:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        return self._status(self._rpc(self._stub.StartModel, pb.ModelRef(model_name=name)))

    def stop_model(self, name: str, force: bool = False) -> AsStatus:
        """As Engine.stop_model; `force`: release the model's requests first, this client's and any other's."""
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        with self._lock:
            mine = [r.handle for (model, _), r in self._live.items() if model == name]
        if mine and force:
            for handle in mine:
                self.release_request(name, handle)
        elif mine:
            return self._fail(AsStatus.ALLSPARK_RUNTIME_ERROR,
                              f"model {name!r} has {len(mine)} unreleased request(s); call release_request for "
                              f"each before stop_model, or stop_model / release_model with force=True to release "
                              f"them")
        return self._status(self._rpc(self._stub.StopModel, pb.ModelRef(model_name=name, force=force)))

    def release_model(self, name: str, force: bool = False) -> AsStatus:
        status = self.stop_model(name, force)
        if status != AsStatus.ALLSPARK_SUCCESS:
            return status
        return self._status(self._rpc(self._stub.ReleaseModel, pb.ModelRef(model_name=name, force=force)))

    # ---- requests ----------------------------------------------------------------------------
    def start_request(self, name: str, inputs: Any, generate_config: Any = None) -> StartResult:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED), None, None
        try:
            ids, raw, gen = parse_request(inputs, generate_config)
            images = request_images(pb, inputs)
        except ConfigError as e:
            return self._fail(e.status, str(e)), None, None
        request = pb.GenerateRequest(model_name=name, input_ids=ids, config=wire.generation_config_to_proto(raw, gen),
                                     session_id=self._session.id if self._session is not None else "",
                                     images=images)
        call = self._stub.Generate(request)
        try:
            first = next(call)
        except grpc.RpcError as e:
            raise self._unavailable(e) from None
        if first.status != 0:
            return self._fail(first.status, first.message), None, None
        handle = RequestHandle(name, first.request_id)
        queue = ResultQueue(context_length=len(ids))
        with self._lock:
            self._live[(name, first.request_id)] = _ClientRequest(handle, queue, call)
        threading.Thread(target=read_generate_stream, args=(call, queue, self.address), daemon=True,
                         name=f"allspark-stream-{first.request_id}").start()
        return AsStatus.ALLSPARK_SUCCESS, handle, queue

    def _live_request(self, name: str, handle) -> tuple[Optional[_ClientRequest], AsStatus]:
        """This client's live request for `handle`, or None with the status Engine would give
        (PARAM_ERROR for a model the pool does not have, ILLEGAL_REQUEST_ID otherwise)."""
        key = (name, handle.request_id) if isinstance(handle, RequestHandle) else None
        with self._lock:
            live = self._live.get(key) if key else None
        if live is not None and live.handle == handle:
            return live, AsStatus.ALLSPARK_SUCCESS
        info = self._rpc(self._stub.GetModelInfo, pb.ModelRef(model_name=name))
        if info.status != 0:
            return None, self._fail(info.status, info.message)
        return None, self._fail(AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID,
                                f"unknown or released request handle {handle!r} for model {name!r}")

    def stop_request(self, name: str, handle: RequestHandle) -> AsStatus:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        live, status = self._live_request(name, handle)
        if live is None:
            return status
        if live.queue.GenerateStatus().is_terminal:
            return AsStatus.ALLSPARK_SUCCESS
        status = self._status(self._rpc(self._stub.StopRequest, pb.RequestRef(model_name=name,
                                                                               request_id=handle.request_id)))
        if status == AsStatus.ALLSPARK_SUCCESS:
            live.queue._wait_terminal(timeout_s=STOP_WAIT_S)   # as with Engine: no token after this returns
        return status

    def release_request(self, name: str, handle: RequestHandle) -> AsStatus:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        live, status = self._live_request(name, handle)
        if live is None:
            return status
        status = self._status(self._rpc(self._stub.ReleaseRequest,
                                        pb.RequestRef(model_name=name, request_id=handle.request_id)))
        with self._lock:
            live = self._live.pop((name, handle.request_id))
        live.queue._wait_terminal(timeout_s=STOP_WAIT_S)   # released: the stream's last reply is on its way
        live.call.cancel()
        return status

    def sync_request(self, name: str, handle: Optional[RequestHandle] = None) -> AsStatus:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        if handle is not None:
            live, status = self._live_request(name, handle)
            if live is None:
                return status
            queues = [live.queue]
        else:
            status = self._status(self._rpc(self._stub.SyncRequest, pb.SyncRequestMsg(model_name=name)))
            if status != AsStatus.ALLSPARK_SUCCESS:
                return status
            with self._lock:
                queues = [r.queue for (model, _), r in self._live.items() if model == name]
        for q in queues:
            q._wait_terminal()
            if q.GenerateStatus() == GenerateRequestStatus.InternalError and pool_failed(q.ErrorMessage()):
                return self._fail(AsStatus.ALLSPARK_RUNTIME_ERROR, q.ErrorMessage())
        return AsStatus.ALLSPARK_SUCCESS

    # ---- information -------------------------------------------------------------------------
    def get_model_info(self, name: str) -> str:
        reply = self._rpc(self._stub.GetModelInfo, pb.ModelRef(model_name=name))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return reply.text

    def get_as_engine_stat(self, name: str) -> AsEngineStat:
        reply = self._rpc(self._stub.GetEngineStat, pb.ModelRef(model_name=name))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return wire.engine_stat_from_proto(reply)

    def get_op_profile(self, name: str) -> OpProfileReport:
        reply = self._rpc(self._stub.GetOpProfile, pb.ModelRef(model_name=name))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return wire.op_profile_from_proto(reply)

    def _model_handles(self, name: str) -> list[RequestHandle]:
        self.get_model_info(name)                     # an unknown model raises, as with Engine
        with self._lock:
            return [r.handle for (model, _), r in self._live.items() if model == name]

    def _save_model(self, name: str, saved_dir: str, with_weight: bool) -> AsStatus:
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, CLOSED)
        return self._status(self._rpc(self._stub.SaveModel, pb.SaveModelRequest(
            model_name=name, saved_dir=saved_dir, with_weight=with_weight)))

    def get_rank_id(self) -> int:
        return 0

    def get_version_full(self) -> str:
        return self._rpc(self._stub.Health, pb.HealthRequest()).version_full

    def is_allspark_work_as_service(self) -> bool:
        return True
