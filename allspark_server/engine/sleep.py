"""Sleep and wake of a served model (DashInfer's unload_device_mem / load_device_mem), Engine's side: a mixin.

Sleep: new requests are refused at once (ALLSPARK_REQUEST_DENIED, saying the model sleeps); on the engine thread the
step in flight completes, every live request ends GenerateInterrupted saying why, the prefix cache forgets the spans
(their content goes), and every rank frees its weights, KV cache and CUDA graphs (runner/residency.py). Wake
restores them on every rank; requests are accepted again, unless a weights file it reads changed since the install
(the model then stays asleep). Sleeping twice, or waking an awake model, does nothing.
Both return None (DashInfer's signature) and raise AsException on failure, as install_model does.
"""
from __future__ import annotations

import logging
from typing import Optional

from allspark_client.types import AsException, AsStatus
from allspark_server.core.messages import DeviceMemMsg
from allspark_server.runner import residency

log = logging.getLogger("allspark")
WAKE_FROM_OPTIONS = ("auto",) + residency.WAKE_FROM


def asleep_message(name: str) -> str:
    return (f"model {name!r} is asleep: unload_device_mem freed its weights and KV cache, so requests are refused "
            f"with ALLSPARK_REQUEST_DENIED until load_device_mem({name!r}) wakes it")


def _interrupted_message(name: str) -> str:
    return (f"stopped: model {name!r} went to sleep (unload_device_mem) while this request ran; new requests get "
            f"ALLSPARK_REQUEST_DENIED until load_device_mem({name!r})")


class DeviceMemory:
    """Engine's unload_device_mem / load_device_mem (it provides _lock, _model, _engine and _comm)."""

    def unload_device_mem(self, name: str, wake_from: Optional[str] = "auto") -> None:
        """Put model `name` to sleep: its weights and KV cache leave memory (GPU: device memory back to the driver;
        CPU: pages back to the OS), running requests are stopped (GenerateInterrupted) and new ones refused until
        load_device_mem. `wake_from`: where wake reads the weights from on a GPU rank, "host" (a pinned host copy:
        wake is a copy over PCIe, host memory holds the weights meanwhile) or "files" (read again from the model
        files: nothing is kept); "auto" (default) is "host" on GPU ranks and "files" on CPU ranks, whose weights
        are host memory already."""
        wake_from = wake_from or "auto"
        if wake_from not in WAKE_FROM_OPTIONS:
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"wake_from must be one of {WAKE_FROM_OPTIONS}, got {wake_from!r}")
        with self._lock:
            model = self._served(name)
            from_host = model.runner.device_kind.can_wake_from_host   # weights apart from host memory (a GPU's)
            if wake_from == "host" and not from_host:
                raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                                  "wake_from='host' keeps a GPU rank's weights in pinned host memory; a CPU rank's "
                                  "weights are host memory already: its sleep releases them and its wake reads the "
                                  "model files again (wake_from='files' or 'auto')")
            if model.asleep:
                log.info("unload_device_mem(%r): the model is asleep already", name)
                return None
            source = wake_from if wake_from != "auto" else ("host" if from_host else "files")
            model.asleep = True      # start_request refuses from now on (it checks under the same lock)

            def sleep():
                step = model.loop.in_flight      # a GPU decode step still running: its tokens are delivered first
                if step is not None:
                    model.loop.in_flight = None
                    model.complete(step)
                model.interrupt_all(_interrupted_message(name))
                model.deliver()
                model.spans.forget_cached()
                self._comm.bcast(DeviceMemMsg(name, True, source))
                residency.sleep(model.runner, source, self._comm)

            try:
                self._engine.call(sleep)
            except residency.DeviceMemError as e:
                model.asleep = False
                raise AsException(AsStatus.ALLSPARK_MEMORY_ERROR, f"unload_device_mem({name!r}): {e}") from None
        log.info("model %r is asleep (wake from %s)", name, source)
        return None

    def load_device_mem(self, name: str) -> None:
        """Wake model `name`: restore its weights, KV cache and (GPU) CUDA graphs on every rank; requests are accepted
        again. A failed wake leaves it asleep, able to try again: a GPU whose memory was taken meanwhile
        (ALLSPARK_MEMORY_ERROR), or a weights file that changed since the install where wake reads the files
        (ALLSPARK_IO_ERROR, before anything is read)."""
        with self._lock:
            model = self._served(name)
            if not model.asleep:
                log.info("load_device_mem(%r): the model is awake already", name)
                return None

            def wake():
                self._comm.bcast(DeviceMemMsg(name, False))
                residency.wake(model.runner, self._comm)

            try:
                self._engine.call(wake)
            except residency.DeviceMemError as e:    # a changed weights file: IO_ERROR, as save_model says it
                status = (AsStatus.ALLSPARK_IO_ERROR if isinstance(e, residency.WeightsChangedError)
                          else AsStatus.ALLSPARK_MEMORY_ERROR)
                raise AsException(status, f"load_device_mem({name!r}): {e}") from None
            model.asleep = False
        log.info("model %r is awake", name)
        return None

    def _served(self, name: str):
        try:
            return self._model(name)
        except Exception as e:   # engine.RequestError: its status and reason, raised as the other calls raise
            if not hasattr(e, "status"):
                raise
            raise AsException(e.status, str(e)) from None
