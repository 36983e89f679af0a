"""The pool's gRPC service on rank 0 (grpc.aio): each RPC is a thin call into the Engine.

Owns request/reply translation only; validation and all state live in the Engine. The server runs on its own
asyncio loop in one thread, so an open stream costs a coroutine, not a thread: thousands of streams can be open
at once. Engine calls that may block (install, stop, sync, start_request's grammar compile) run on a bounded
thread pool. Generate is a server stream fed from the request's ResultQueue, which wakes the stream's coroutine
when it has news (a listener hook): a reply per batch of new tokens, and a last one with the terminal status, the
tokens still left and the stats. A client that goes away mid-stream has its request released; otherwise the
client releases it (ReleaseRequest), as with Engine. Past `max_streams` open Generate streams a new one is
refused at once with ALLSPARK_REQUEST_DENIED saying so (overload, not a lost pool); other calls are never refused.
A stream whose client stops reading is dropped after `stream_stall_s` (DropStalledStreams), its request released.
A request delivered to a client that then dies unreleased is released `orphan_grace_s` after the client's Attach
stream ended, if it does not come back (sessions.py); StopModel / ReleaseModel with `force` release a model's
requests, whoever holds them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from concurrent import futures
from typing import Callable, Optional

import grpc

from allspark_client import wire
from allspark_client._proto import allspark_pb2 as pb
from allspark_client._proto import allspark_pb2_grpc as pb_grpc
from allspark_client.channel import MAX_MESSAGE_BYTES
from allspark_client.image_inputs import images_from_proto
from allspark_client.types import AsException, AsStatus, GenerateRequestStatus, RequestHandle
from allspark_client.validation import ConfigError
from allspark_server.build_info import version_full
from allspark_server.engine.engine import Engine
from allspark_server.pool.interceptors import STREAM_STALL_S, DropStalledStreams, GuardCalls
from allspark_server.pool.sessions import Sessions

log = logging.getLogger(__name__)
ENGINE_CALL_THREADS = 64     # concurrent blocking Engine calls (a sync_request may hold one for long)
HANDSHAKE_TIMEOUT_MS = 10_000  # gRPC's default is 120 s
ORPHAN_GRACE_S = 30.0        # default: a gone client's finished requests are released this long after it left


class AllsparkServicer(pb_grpc.AllsparkServicer):
    def __init__(self, engine: Engine, world_size: int, max_streams: int = 4096,
                 stream_stall_s: Optional[float] = None, orphan_grace_s: Optional[float] = None):
        self.engine = engine
        self.world_size = world_size
        self.max_streams = max_streams
        self.stream_stall_s = stream_stall_s or STREAM_STALL_S      # DropStalledStreams
        self.ready = False
        self.stopping: Optional[str] = None    # set on SIGTERM: why new calls are refused (GuardCalls)
        self._open_streams = 0   # written on the event loop's thread only
        self._queues: set = set()    # the ResultQueues of open Generate streams (cut_off_streams)
        self._queues_lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(ENGINE_CALL_THREADS, thread_name_prefix="allspark-call")
        self.sessions = Sessions(orphan_grace_s or ORPHAN_GRACE_S,
                                 lambda handle, grace: self._pool.submit(self._release_orphan, handle, grace))

    def refusal(self) -> Optional[str]:
        """Why a new call is refused UNAVAILABLE (the pool is stopping or going down), or None."""
        return self.stopping or self.engine.down_reason()

    def wait_streams_closed(self, timeout_s: float) -> bool:
        """Block until every open stream has handed its last reply to gRPC; False after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self._open_streams:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    async def _run(self, fn: Callable, *args):
        """fn(*args) on the call pool (Engine calls block; the last error is per thread, so read it there too)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _status_of(self, fn: Callable, *args) -> pb.StatusReply:
        status = fn(*args)
        return pb.StatusReply(status=int(status), message="" if status == 0 else self.engine.get_last_error())

    async def Health(self, request, context):
        return pb.HealthReply(ready=self.ready, protocol_version=wire.PROTOCOL_VERSION,
                              version_full=version_full(), world_size=self.world_size, pid=os.getpid())

    def _install(self, request) -> pb.StatusReply:
        try:
            return self._status_of(self.engine.install_model, wire.runtime_config_from_proto(request))
        except ConfigError as e:
            return pb.StatusReply(status=int(e.status), message=str(e))
        except AsException as e:
            return pb.StatusReply(status=int(e.status), message=e.message)

    async def InstallModel(self, request, context):
        return await self._run(self._install, request)

    async def StartModel(self, request, context):
        return await self._run(self._status_of, self.engine.start_model, request.model_name)

    async def StopModel(self, request, context):
        return await self._model_call(self.engine.stop_model, request)

    async def ReleaseModel(self, request, context):
        return await self._model_call(self.engine.release_model, request)

    async def _model_call(self, method, request) -> pb.StatusReply:
        """stop_model / release_model, with `force` when the caller asked to release the model's requests."""
        args = (request.model_name, True) if request.force else (request.model_name,)
        reply = await self._run(self._status_of, method, *args)
        if request.force and reply.status == 0:
            self.sessions.forget_model(request.model_name)
        return reply

    async def Attach(self, request, context):
        """Open while the client lives (sessions.py): one reply, then nothing until the client goes away."""
        session_id = request.session_id
        if not Sessions.valid(session_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Attach: session_id must have 1 to 128 characters")
        self.sessions.attach(session_id)
        try:
            yield pb.AttachReply(release_after_s=self.sessions.grace_s)
            await asyncio.Event().wait()       # until cancelled: the client left, or the server stops
        finally:
            self.sessions.detach(session_id)

    def _release_orphan(self, handle: RequestHandle, grace_s: float) -> None:
        if self.engine.has_request(handle.model_name, handle):
            log.warning("releasing request %d of model %r: its client has been gone for %.0f s without releasing it",
                        handle.request_id, handle.model_name, grace_s)
            self.engine.release_request(handle.model_name, handle)

    def _embed(self, request) -> pb.EmbedReply:
        try:
            vectors = self.engine.embed(request.model_name, [list(t.ids) for t in request.inputs],
                                        request.pooling, request.normalize)
        except AsException as e:
            return pb.EmbedReply(status=int(e.status), message=e.message)
        dim, data = wire.embeddings_to_bytes(vectors)
        return pb.EmbedReply(status=0, dim=dim, data=data)

    async def Embed(self, request, context):
        return await self._run(self._embed, request)

    def _start(self, request):
        gen = wire.generation_config_from_proto(request.config)
        inputs = {"input_ids": list(request.input_ids)}
        if request.HasField("images"):
            try:
                inputs.update(images_from_proto(request.images))
            except ConfigError as e:
                return e.status, None, None, str(e)
        status, handle, queue = self.engine.start_request(request.model_name, inputs, gen)
        return status, handle, queue, ("" if status == 0 else self.engine.get_last_error())

    async def Generate(self, request, context):
        if self._open_streams >= self.max_streams:
            yield pb.GenerateReply(status=int(AsStatus.ALLSPARK_REQUEST_DENIED),
                                   message=f"the pool is serving its maximum of {self.max_streams} concurrent streams "
                                           f"(allspark-launch --max-streams); retry later")
            return
        self._open_streams += 1
        try:
            async with contextlib.aclosing(self._generate(request)) as replies:   # closed now, not at GC
                async for reply in replies:
                    yield reply
        finally:
            self._open_streams -= 1

    async def _generate(self, request):
        if request.session_id and not Sessions.valid(request.session_id):
            yield pb.GenerateReply(status=int(AsStatus.ALLSPARK_PARAM_ERROR),
                                   message="session_id must have 1 to 128 characters")
            return
        status, handle, queue, error = await self._run(self._start, request)
        if status != AsStatus.ALLSPARK_SUCCESS:
            yield pb.GenerateReply(status=int(status), message=error)
            return
        if request.session_id:
            self.sessions.own(request.session_id, handle)
        with self._queues_lock:
            self._queues.add(queue)
        loop = asyncio.get_running_loop()
        news = asyncio.Event()
        queue._set_listener(lambda: loop.call_soon_threadsafe(news.set))
        delivered = False   # set once the last reply is out: the client owns the release from then on
        try:
            yield pb.GenerateReply(status=0, request_id=handle.request_id, generate_status=int(queue.GenerateStatus()))
            while True:
                news.clear()                   # cleared before looking: a push after the look sets it again
                # The status before the tokens: the engine pushes a request's last tokens before its terminal
                # status, so a terminal status read first means the take below holds every token that is left.
                # (Read the other way round, a reply could say "finished" while tokens were still to come, and a
                # reader would stop at that reply.)
                gen_status = queue.GenerateStatus()
                el = queue.GetNoWait()
                if el is None and not gen_status.is_terminal:
                    await news.wait()
                    continue
                reply = pb.GenerateReply(status=0, request_id=handle.request_id, generate_status=int(gen_status))
                if el is not None:
                    wire.elements_to_reply(el, reply)
                if not gen_status.is_terminal:
                    yield reply
                    continue
                # terminal: the last reply carries the last tokens, the reason (if any) and the stats
                reply.message = queue.ErrorMessage() or ""
                reply.stats.CopyFrom(wire.stats_to_proto(queue.RequestStatInfo()))
                yield reply
                delivered = True
                return
        finally:
            queue._set_listener(None)
            with self._queues_lock:
                self._queues.discard(queue)
            if not delivered:   # cancelled (the client went away): nobody else can release it now
                self.sessions.forget(handle.model_name, handle.request_id)
                self._pool.submit(self._release_if_live, handle)

    def cut_off_streams(self, reason: str) -> int:
        """End every open stream whose request is still running in InternalError with `reason` (any thread): the
        pool is stopping, and the engine's stop would end those requests GenerateFinished, so that output cut off
        mid-way would look complete to the client. Returns how many were cut off."""
        with self._queues_lock:
            queues = list(self._queues)
        cut = 0
        for queue in queues:
            if not queue.GenerateStatus().is_terminal:
                queue._set_status(GenerateRequestStatus.InternalError, reason)   # a terminal status is final
                cut += 1
        return cut

    def _release_if_live(self, handle: RequestHandle) -> None:
        if self.engine.has_request(handle.model_name, handle):
            self.engine.release_request(handle.model_name, handle)

    async def StopRequest(self, request, context):
        return await self._run(self._status_of, self.engine.stop_request, request.model_name,
                               RequestHandle(request.model_name, request.request_id))

    async def ReleaseRequest(self, request, context):
        reply = await self._run(self._status_of, self.engine.release_request, request.model_name,
                                RequestHandle(request.model_name, request.request_id))
        self.sessions.forget(request.model_name, request.request_id)
        return reply

    async def SyncRequest(self, request, context):
        handle = RequestHandle(request.model_name, request.request_id) if request.HasField("request_id") else None
        return await self._run(self._status_of, self.engine.sync_request, request.model_name, handle)

    def _model_info(self, name: str) -> pb.TextReply:
        try:
            return pb.TextReply(status=0, text=self.engine.get_model_info(name))
        except AsException as e:
            return pb.TextReply(status=int(e.status), message=e.message)

    async def GetModelInfo(self, request, context):
        return await self._run(self._model_info, request.model_name)

    def _engine_stat(self, name: str) -> pb.EngineStat:
        try:
            return wire.engine_stat_to_proto(self.engine.get_as_engine_stat(name))
        except AsException as e:
            return pb.EngineStat(status=int(e.status), message=e.message)

    async def GetEngineStat(self, request, context):
        return await self._run(self._engine_stat, request.model_name)

    def _op_profile(self, name: str) -> pb.OpProfile:
        try:
            return wire.op_profile_to_proto(self.engine.get_op_profile(name))
        except AsException as e:
            return pb.OpProfile(status=int(e.status), message=e.message)

    async def GetOpProfile(self, request, context):
        return await self._run(self._op_profile, request.model_name)

    async def SaveModel(self, request, context):
        return await self._run(self._status_of, self.engine.save_model, request.model_name, request.saved_dir,
                               request.with_weight)

    def _device_mem(self, method, *args) -> pb.StatusReply:
        try:
            method(*args)
        except AsException as e:
            return pb.StatusReply(status=int(e.status), message=e.message)
        return pb.StatusReply(status=0)

    async def UnloadDeviceMem(self, request, context):
        return await self._run(self._device_mem, self.engine.unload_device_mem, request.model_name, request.wake_from)

    async def LoadDeviceMem(self, request, context):
        return await self._run(self._device_mem, self.engine.load_device_mem, request.model_name)


    def _lora_status(self, method, *args) -> pb.StatusReply:
        try:
            return self._status_of(method, *args)
        except AsException as e:
            return pb.StatusReply(status=int(e.status), message=e.message)

    async def LoadLora(self, request, context):
        path = request.path if request.HasField("path") else None
        return await self._run(self._lora_status, self.engine.load_lora, request.model_name, request.lora_name, path)

    async def UnloadLora(self, request, context):
        return await self._run(self._lora_status, self.engine.unload_lora, request.model_name, request.lora_name)

    def _list_loras(self, name: str) -> pb.LoraList:
        try:
            return pb.LoraList(status=0, lora_names=self.engine.list_loras(name))
        except AsException as e:
            return pb.LoraList(status=int(e.status), message=e.message)

    async def ListLoras(self, request, context):
        return await self._run(self._list_loras, request.model_name)


class PoolServer:
    """The grpc.aio server on its own event loop thread, driven from the (synchronous) rank-0 main thread."""

    def __init__(self, servicer: AllsparkServicer, address: str, access):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="allspark-grpc", daemon=True)
        self._thread.start()
        try:
            self._server = self._submit(self._start(servicer, address, access)).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @staticmethod
    async def _start(servicer, address: str, access):
        from allspark_server.pool import access as acl
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   # a connection that has not completed its handshake by then is closed (slowloris)
                   ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                   # a TCP client whose host vanished (no FIN, no RST) is found gone, and with it its session
                   # (sessions.py): a ping every minute, unanswered for 20 s closes the connection
                   ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000)]
        # the first is outermost: it writes the replies GuardCalls and the servicer produce
        guards = ([DropStalledStreams(servicer.stream_stall_s)] + acl.interceptors(access)
                  + [GuardCalls(servicer.refusal)])
        server = grpc.aio.server(options=options, interceptors=guards)
        pb_grpc.add_AllsparkServicer_to_server(servicer, server)
        acl.bind(server, address, access)
        await server.start()
        return server

    def stop(self, grace: float) -> "futures.Future":
        """Refuse new calls and end open ones after `grace` seconds; the returned future is done once stopped
        (`.result()` / `.wait()` waits)."""
        return self._submit(self._server.stop(grace))


def start_server(servicer: AllsparkServicer, address: str, access=None) -> PoolServer:
    """Bind `address` ('unix:/path' or 'host:port') under `access` (access.py; None: no token, no TLS) and
    start serving."""
    from allspark_server.pool.access import Access
    return PoolServer(servicer, address, access or Access())
