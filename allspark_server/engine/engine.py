"""Engine: allspark's public API (DashInfer names) over the process's EngineThread.

Validates every call in the caller's thread (so errors come back at once, with a message), hands
accepted requests to the engine thread and returns a ResultQueue to read tokens from. Model
lifecycle calls run on the engine thread, which also tells the other ranks of a pool. The same
class serves in-process users and, on rank 0, a pool's gRPC service.
Status-returning calls log the reason for a failure and keep it for `get_last_error()`.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from allspark_client import settings
from allspark_client.api import EngineAPI, StartResult
from allspark_client.config import AsModelConfig
from allspark_client.generation_config import parse_request, resolve_max_length
from allspark_client.image_inputs import parse_image_inputs
from allspark_client.op_profile_report import OpProfileReport
from allspark_client.result_queue import ResultQueue
from allspark_client.types import POOL_DOWN, AsEngineStat, AsException, AsStatus, GenerateRequestStatus, RequestHandle
from allspark_client.validation import ConfigError
from allspark_server.collective.comm import get_comm
from allspark_server.core.messages import InstallModelMsg, OpProfileMsg, ReleaseModelMsg
from allspark_server.core.request import Request
from allspark_server.engine.commands import AddRequest, StopRequest
from allspark_server.engine.embed_api import EmbedAPI
from allspark_server.engine.image_tower import tower_of
from allspark_server.engine.lora_api import LoraAPI
from allspark_server.engine.peer_watch import PeerWatch, RankIdentity, exit_now
from allspark_server.engine.served_model import ServedModel
from allspark_server.engine.sleep import DeviceMemory, asleep_message
from allspark_server.engine.step_watchdog import StepWatchdog
from allspark_server.engine.thread import EngineThread, ForModel
from allspark_server.loader.model_file import save_model_files
from allspark_server.runner.model_runner import install_runner
from allspark_server.runner.sampler import SamplingState

log = logging.getLogger("allspark")


class RequestError(Exception):
    def __init__(self, status: AsStatus, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _LiveRequest:
    handle: RequestHandle
    queue: ResultQueue


HANG_GRACE_S = 1.0      # a pool going down: time for the streams' errors to reach their clients before the exit
SHUT_DOWN = "the engine is shut down: shutdown() or close() was called"


class Engine(DeviceMemory, LoraAPI, EmbedAPI, EngineAPI):
    _live_request = _LiveRequest     # EmbedAPI's record of a request
    def __init__(self, comm=None, step_timeout: Optional[float] = None,
                 ranks: Optional[list[Optional[RankIdentity]]] = None):
        """`step_timeout`: in a pool, seconds a step may take before the pool is declared hung (None: 10 s
        beyond what the slowest step so far predicts; see step_watchdog.py). `ranks`: in a pool, every rank's
        peer_watch.identity(): rank 0 exits as soon as one on its own machine dies (peer_watch.py)."""
        self._comm = comm or get_comm()
        pool = self._comm.world_size > 1
        # a hung step: MPI_Abort, so that mpirun ends every rank, here or on other hosts; a dead rank on this
        # machine: exit at once (MPI_Abort goes through mpirun, which may be what is slow)
        self._watchdog = (StepWatchdog(lambda reason: self._pool_down(reason, lambda: self._comm.abort(1)),
                                       step_timeout) if pool else None)
        self._peers = (PeerWatch(ranks, lambda reason: self._pool_down(reason, lambda: exit_now(reason)))
                       if pool and ranks else None)
        self._down: Optional[str] = None       # why the pool is going down (a hung step, a lost rank), once it is
        self._closed = False                   # shutdown() was called: every call is refused (INVALID_CALL_ERROR)
        self._engine = EngineThread(self._comm, self._peers.stand_down if self._peers else None)
        self._models: dict[str, ServedModel] = self._engine.models   # written on the engine thread only
        self._requests: dict[str, dict[int, _LiveRequest]] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._errors = threading.local()

    def _model(self, name: str) -> ServedModel:
        if self._closed:
            raise RequestError(AsStatus.ALLSPARK_INVALID_CALL_ERROR, SHUT_DOWN)
        model = self._models.get(name)
        if model is None:
            raise RequestError(AsStatus.ALLSPARK_PARAM_ERROR,
                               f"model {name!r} is not installed (installed: {sorted(self._models)})")
        return model

    # ---- model lifecycle ---------------------------------------------------------------------
    def install_model(self, cfg: AsModelConfig) -> AsStatus:
        if not isinstance(cfg, AsModelConfig):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"install_model takes an AsModelConfig, got {type(cfg).__name__}")
        try:   # AS_PROFILE=ON: decided here, on rank 0, for every rank
            if not cfg.enable_profiling and settings.profiling_requested():
                cfg = replace(cfg, enable_profiling=True)
        except settings.SettingError as e:
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, str(e)) from None
        with self._lock:
            if self._closed:
                raise AsException(AsStatus.ALLSPARK_INVALID_CALL_ERROR, SHUT_DOWN)
            if cfg.model_name in self._models:
                raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"model {cfg.model_name!r} is already installed")

            def install():
                self._comm.bcast(InstallModelMsg(cfg))
                self._models[cfg.model_name] = ServedModel(cfg, install_runner(cfg, self._comm), self._comm,
                                                           self._watchdog)

            try:
                self._engine.call(install)
            except Exception as e:   # any load failure is reported the same way, with its reason
                raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"cannot install model {cfg.model_name!r}: {e}") from e
            self._requests[cfg.model_name] = {}
        runner = self._models[cfg.model_name].runner
        log.info("installed %s: %d KV spans of %d tokens (%s, %.1f MiB per rank)", cfg.model_name, runner.num_spans,
                 cfg.cache_span_size, runner.kv_mode or "unquantized", runner.kv_cache_bytes / 2**20)
        return AsStatus.ALLSPARK_SUCCESS

    def start_model(self, name: str) -> AsStatus:
        with self._lock:
            try:
                model = self._model(name)
            except RequestError as e:
                return self._fail(e.status, str(e))
            self._engine.call(lambda: setattr(model, "started", True))
        return AsStatus.ALLSPARK_SUCCESS

    def stop_model(self, name: str, force: bool = False) -> AsStatus:
        """Stop serving `name`. Refused while requests of it are unreleased, unless `force`: an operator's way
        past requests whose holder will never release them (each is stopped and released first)."""
        if force:
            self._release_all(name)
        with self._lock:
            try:
                model = self._model(name)
            except RequestError as e:
                return self._fail(e.status, str(e))
            live = self._requests[name]
            if live:
                return self._fail(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                  f"model {name!r} has {len(live)} unreleased request(s); call release_request "
                                  f"for each before stop_model, or stop_model / release_model with force=True "
                                  f"to release them")
            self._engine.call(lambda: setattr(model, "started", False))
        return AsStatus.ALLSPARK_SUCCESS

    def _release_all(self, name: str) -> None:
        with self._lock:
            live = [r.handle for r in self._requests.get(name, {}).values()] if name in self._models else []
        for handle in live:
            self.release_request(name, handle)
        if live:
            log.warning("model %r: released %d request(s) on force", name, len(live))

    def release_model(self, name: str, force: bool = False) -> AsStatus:
        """stop_model (with `force`: after releasing the model's requests), then drop the model."""
        status = self.stop_model(name, force)
        if status != AsStatus.ALLSPARK_SUCCESS:
            return status

        def release():
            self._comm.bcast(ReleaseModelMsg(name))
            model = self._models.pop(name, None)
            if model is not None:
                model.close()

        with self._lock:
            self._engine.call(release)
            self._requests.pop(name, None)
        return AsStatus.ALLSPARK_SUCCESS

    def shutdown(self) -> Optional[str]:
        """Stop every request, end the engine thread and (in a pool) tell the other ranks to exit. Returns
        None, or why a pool could not shut down cleanly (a rank did not answer; open requests then failed).
        Afterwards every call is refused with ALLSPARK_INVALID_CALL_ERROR, returned by the calls that return a
        status, raised (AsException) by others."""
        with self._lock:      # a call holding it finishes first; the next one sees the flag
            self._closed = True
        return self._engine.shutdown()

    def close(self) -> None:
        """shutdown(), as ClientEngine.close(): also what `with Engine() as engine:` calls at the end."""
        self.shutdown()

    def down_reason(self) -> Optional[str]:
        """None while the engine serves; once a pool cannot go on (a hung step, a lost rank), why (it is about to
        exit)."""
        return self._down

    def _pool_down(self, reason: str, leave: Callable[[], None]) -> None:
        """The pool cannot go on (called on a watch's own thread; the engine thread may be stuck in a collective):
        every open stream ends in InternalError with `reason` and POOL_DOWN, new calls get UNAVAILABLE, and once
        the errors had HANG_GRACE_S to reach their clients, `leave()` ends this process non-zero."""
        message = f"{reason}; {POOL_DOWN}"
        self._down = message
        locked = self._lock.acquire(timeout=HANG_GRACE_S)     # a lifecycle call may hold it, stuck as well
        try:
            queues = [r.queue for reqs in list(self._requests.values()) for r in list(reqs.values())]
        finally:
            if locked:
                self._lock.release()
        for q in queues:
            q._set_status(GenerateRequestStatus.InternalError, message)
        time.sleep(HANG_GRACE_S)
        leave()

    # ---- requests ----------------------------------------------------------------------------
    def start_request(self, name: str, inputs: Any, generate_config: Any = None) -> StartResult:
        try:
            return self._start_request(name, inputs, generate_config)
        except RequestError as e:
            return self._fail(e.status, str(e)), None, None

    def _start_request(self, name: str, inputs: Any, generate_config: Any) -> StartResult:
        model = self._model(name)
        if not model.started:
            raise RequestError(AsStatus.ALLSPARK_REQUEST_DENIED, f"model {name!r} is not started")
        if model.asleep:
            raise RequestError(AsStatus.ALLSPARK_REQUEST_DENIED, asleep_message(name))
        try:
            ids, _, gen = parse_request(inputs, generate_config, model.runner.args.vocab_size)
            if gen.eos_token_ids is None:
                gen = replace(gen, eos_token_ids=model.runner.model_file.eos_token_ids)
            max_length = resolve_max_length(gen, len(ids), model.cfg.engine_max_length)
            sampling = SamplingState.create(gen)
            if gen.response_format is not None:   # compiled here, in the caller's thread: a bad schema fails now
                sampling.guided = model.guided_state(gen.response_format)
            images = parse_image_inputs(inputs)  # encoded here too (engine/image_tower.py): a bad image fails now
            images = tower_of(model).prompt_images(ids, *images) if images is not None else None
        except ConfigError as e:
            raise RequestError(e.status, str(e)) from None
        capacity = model.spans.num_spans * model.spans.span_size
        if len(ids) + 1 > capacity:
            raise RequestError(AsStatus.ALLSPARK_CACHE_MEMORY_OUT,
                               f"prompt of {len(ids)} tokens does not fit in the KV cache ({capacity} tokens)")
        rid = next(self._ids)
        handle = RequestHandle(name, rid)
        queue = ResultQueue(context_length=len(ids))
        req = Request(rid, ids, max_length, gen.eos_token_ids, gen.stop_words_ids, gen.min_length, sampling=gen,
                      prompt_logprobs_pending=gen.prompt_logprobs is not None, images=images,
                      cache_salt="" if images is None else "images:" + images.key)
        with self._lock:   # stop_model holds this lock too: a request never lands in a stopped model
            self._model(name)                  # shut down meanwhile: INVALID_CALL_ERROR
            if self._models.get(name) is not model or not model.started:
                raise RequestError(AsStatus.ALLSPARK_REQUEST_DENIED, f"model {name!r} is not started")
            if model.asleep:
                raise RequestError(AsStatus.ALLSPARK_REQUEST_DENIED, asleep_message(name))
            try:   # unload_lora takes this lock too: the adapter stays loaded while the request lives
                adapter = model.adapters.resolve(gen.lora_name)
            except LookupError as e:
                raise RequestError(AsStatus.ALLSPARK_LORA_NOT_FOUND, str(e)) from None
            if adapter is not None:
                req.lora_slot, req.cache_salt = adapter.slot, adapter.key + req.cache_salt
            self._requests[name][rid] = _LiveRequest(handle, queue)
            self._engine.post(ForModel(name, AddRequest(req, queue, sampling,
                                                        prompt_rows={} if req.prompt_logprobs_pending else None)))
        return AsStatus.ALLSPARK_SUCCESS, handle, queue

    def _live(self, name: str, handle) -> _LiveRequest:
        self._model(name)
        rid = handle.request_id if isinstance(handle, RequestHandle) else None
        live = self._requests[name].get(rid) if rid is not None else None
        if live is None or live.handle != handle:
            raise RequestError(AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID,
                               f"unknown or released request handle {handle!r} for model {name!r}")
        return live

    def _model_handles(self, name: str) -> list[RequestHandle]:
        with self._lock:
            try:
                self._model(name)
            except RequestError as e:
                raise AsException(e.status, str(e)) from None
            return [r.handle for r in self._requests[name].values()]

    def _save_model(self, name: str, saved_dir: str, with_weight: bool) -> AsStatus:
        try:
            save_model_files(self._model(name).runner.model_file, saved_dir, name, with_weight)
        except RequestError as e:
            return self._fail(e.status, str(e))
        except (OSError, ValueError) as e:
            return self._fail(AsStatus.ALLSPARK_IO_ERROR, f"save_model {name!r} to {saved_dir!r}: {e}")
        return AsStatus.ALLSPARK_SUCCESS

    def has_request(self, name: str, handle: RequestHandle) -> bool:
        """True while `handle` is a live (unreleased) request of model `name`."""
        with self._lock:
            live = self._requests.get(name, {}).get(getattr(handle, "request_id", None))
        return live is not None and live.handle == handle

    def stop_request(self, name: str, handle: RequestHandle) -> AsStatus:
        try:
            live = self._live(name, handle)
        except RequestError as e:
            return self._fail(e.status, str(e))
        cmd = StopRequest(live.handle.request_id)
        self._engine.post(ForModel(name, cmd))
        cmd.done.wait()   # afterwards no token can arrive for it
        return AsStatus.ALLSPARK_SUCCESS

    def release_request(self, name: str, handle: RequestHandle) -> AsStatus:
        status = self.stop_request(name, handle)
        if status == AsStatus.ALLSPARK_SUCCESS:
            with self._lock:
                self._requests[name].pop(handle.request_id, None)
        return status

    def sync_request(self, name: str, handle: Optional[RequestHandle] = None) -> AsStatus:
        try:
            if handle is None:
                self._model(name)
                with self._lock:
                    queues = [r.queue for r in self._requests[name].values()]
            else:
                queues = [self._live(name, handle).queue]
        except RequestError as e:
            return self._fail(e.status, str(e))
        for q in queues:
            q._wait_terminal()
        return AsStatus.ALLSPARK_SUCCESS

    # ---- information -------------------------------------------------------------------------
    def get_model_info(self, name: str) -> str:
        try:
            model = self._model(name)
        except RequestError as e:
            raise AsException(e.status, str(e)) from None
        r = model.runner
        return json.dumps({"model_name": name, "architecture": r.args.architecture,
                           "dtype": str(r.dtype).replace("torch.", ""), "device": str(r.device),
                           "args": r.args.to_dict(),
                           "engine_max_length": model.cfg.engine_max_length,
                           "engine_max_batch": model.cfg.engine_max_batch,
                           "kv_spans": r.num_spans, "span_size": r.span_size, "kv_cache_bytes": r.kv_cache_bytes,
                           "kv_cache_mode": r.kv_mode or "default",
                           "quantization": r.quant.describe() if r.quant else None,
                           "world_size": self._comm.world_size, "started": model.started, "asleep": model.asleep})

    def get_as_engine_stat(self, name: str) -> AsEngineStat:
        try:
            return self._model(name).stat(queued=self._engine.queued_requests(name))
        except RequestError as e:
            raise AsException(e.status, str(e)) from None

    def get_op_profile(self, name: str) -> OpProfileReport:
        """Every rank's op timings of model `name` since it was installed (allspark_client/op_profile_report.py);
        a report with enabled=False when it was installed without profiling."""
        try:
            model = self._model(name)
        except RequestError as e:
            raise AsException(e.status, str(e)) from None
        if model.runner.profiler is None:
            return OpProfileReport(name, False)

        def gather():     # a collective: on the engine thread, between steps
            self._comm.bcast(OpProfileMsg(name))
            return self._comm.allgather_obj(model.runner.profiler.snapshot(self._comm.rank))

        ranks = self._engine.call(gather)
        return OpProfileReport(name, True, tuple(op for ops, _ in ranks for op in ops),
                               tuple(steps for _, steps in ranks), model.runner.profiler.clock)

    def get_rank_id(self) -> int:
        return self._comm.rank

    def get_version_full(self) -> str:
        from allspark_server.build_info import version_full
        return version_full()

    def is_allspark_work_as_service(self) -> bool:
        return False
