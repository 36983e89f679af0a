"""The loop of a pool's worker ranks (1..N-1): receive what rank 0 broadcasts and do it.

Workers hold no scheduler state: a StepPlan says exactly what to compute; install and release
messages load or drop a model shard; LoRA messages load or unload an adapter (runner/adapters.py); device-memory
messages put one to sleep or wake it (runner/residency.py).
Any exception propagates, and the rank's main aborts the whole MPI job — a pool is healthy or dead, never half
alive.
"""
from __future__ import annotations

import logging

from allspark_server.core.messages import (
    DeviceMemMsg,
    InstallModelMsg,
    LoraMsg,
    OpProfileMsg,
    ReleaseModelMsg,
    ShutdownMsg,
    StepMsg,
)
from allspark_server.runner import adapters, residency
from allspark_server.runner.model_runner import InstallError, ModelRunner, install_runner

log = logging.getLogger(__name__)


def run_worker(comm) -> None:
    runners: dict[str, ModelRunner] = {}
    while True:
        msg = comm.bcast(None)
        if isinstance(msg, StepMsg):
            runners[msg.model_name].execute(msg.plan)
        elif isinstance(msg, InstallModelMsg):
            try:
                runners[msg.config.model_name] = install_runner(msg.config, comm)
            except InstallError as e:   # every rank saw it; rank 0 reports it to the caller
                log.info("install of %s failed: %s", msg.config.model_name, e)
        elif isinstance(msg, LoraMsg):
            adapters.apply(runners[msg.model_name], msg, comm)
        elif isinstance(msg, ReleaseModelMsg):
            runners.pop(msg.model_name, None)
        elif isinstance(msg, OpProfileMsg):
            comm.allgather_obj(runners[msg.model_name].profiler.snapshot(comm.rank))
        elif isinstance(msg, DeviceMemMsg):
            runner = runners[msg.model_name]
            try:
                if msg.sleep:
                    residency.sleep(runner, msg.wake_from, comm)
                else:
                    residency.wake(runner, comm)
            except residency.DeviceMemError as e:   # every rank saw it; rank 0 reports it to the caller
                log.info("%s", e)
        elif isinstance(msg, ShutdownMsg):
            comm.barrier()      # rank 0 waits for this answer before it calls its streams cleanly ended
            return
        else:
            raise TypeError(f"worker got an unknown message {type(msg).__name__}")
