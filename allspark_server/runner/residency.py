"""Sleep and wake of one rank's model (unload_device_mem / load_device_mem): its weights and KV cache leave memory
and come back, in the same tensor objects, so whatever holds them (the layers, the bound decode steps, the native
decode stack) sees them come back.

GPU rank: the storage under every model tensor and every KV page is resized to nothing and the decode CUDA graphs
are dropped, then torch's cached blocks and cuBLAS's workspaces go back to the driver. The weights wait in pinned
host memory (wake_from "host") or are read again from the model files ("files"). Wake resizes the storages back (new
addresses, hence new graphs), refills the weights, zeroes the cache and captures the graphs again.
CPU rank: the pages under the weights and the KV cache go back to the OS (madvise MADV_DONTNEED, at the same
addresses, so the native decode stack's pointers stay valid); wake reads the weights from the files into the same
memory, and the cache's pages come back, zero, as they are written. (A CPU rank has no other copy to keep.)
A wake that reads the files refuses, before it restores anything, where a weights file changed since the install.
Collective: every rank of a pool runs it at once, and all agree before anything is dropped.
Which of the two a rank does is its device kind's `sleep_frees_storages` (compute/device_kind.py).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from allspark_server.loader.model_file import weights_changed
from allspark_server.loader.rank_weights import read_rank_state

if TYPE_CHECKING:
    from allspark_server.compute.cuda.host_arena import HostArena

log = logging.getLogger(__name__)
WAKE_FROM = ("host", "files")
MADV_DONTNEED = 4        # Linux's value (<sys/mman.h>)
HOST_ALIGN = 512         # each storage's copy in the host arena starts at a multiple of this


class DeviceMemError(RuntimeError):
    """A rank could not sleep or wake (every rank raises it, with each failing rank's reason)."""


class WeightsChangedError(DeviceMemError):
    """Wake would read the model files again, and the weights file is no longer the one the model was installed from
    (every rank raises it before anything is restored: the model stays asleep)."""


@dataclass
class Asleep:
    """A sleeping rank's state: what wake restores. `weights` / `kv`: one tensor per storage with the storage's bytes;
    `host`: (GPU) the copy of each model storage that is not read from the files, in `arena`."""
    wake_from: str
    weights: list[tuple[torch.Tensor, int]]
    file_backed: list[bool]
    kv: list[tuple[torch.Tensor, int]]
    host: dict[int, torch.Tensor] = field(default_factory=dict)
    arena: Optional["HostArena"] = None   # the device kind's pinned_host_arena


def _storages(tensors) -> list[tuple[torch.Tensor, int]]:
    """One (tensor, storage bytes) per distinct storage among `tensors` (a tied head shares the embedding's)."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append((t, s.nbytes()))
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _kv_tensors(runner) -> list:
    return [x for layer in runner.kv.layers for x in layer] if runner.kv is not None else []


def _file_names(runner) -> dict[str, torch.Tensor]:
    """The model's persistent tensors by name: exactly what read_rank_state reads (the install loaded it strictly)."""
    return {name: t.detach() for name, t in runner.model.state_dict(keep_vars=True).items()}


def _cpu_release(tensors: list[tuple[torch.Tensor, int]]) -> None:
    """Hand the pages under each storage back to the OS (they read as zero afterwards); bytes of a partly covered
    page at either end are zeroed instead."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for t, nbytes in tensors:
        ptr = t.untyped_storage().data_ptr()
        lo, hi = -(-ptr // page) * page, (ptr + nbytes) // page * page
        raw = _bytes_of(t)
        if hi <= lo:
            raw.zero_()
            continue
        raw[:lo - ptr].zero_()
        raw[hi - ptr:].zero_()
        if libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {hi - lo} bytes failed")
    try:
        libc.malloc_trim(0)     # glibc: freed heap (this call's temporaries, earlier ones) back to the OS too
    except AttributeError:
        pass


def _free_storages(runner, state: Asleep) -> None:
    runner.graphs = None                    # its private pool and static buffers go with it
    runner.device_kind.synchronize()
    for t, _ in state.weights + state.kv:
        t.untyped_storage().resize_(0)
    runner.device_kind.release_cached_memory()   # cuBLAS's workspaces, then every freed block back to the driver


def _release(runner, state: Asleep) -> None:
    runner.mirrors.clear()                  # every request ended before the sleep
    if runner.device_kind.sleep_frees_storages:
        _free_storages(runner, state)
    else:
        _cpu_release(state.weights + state.kv)


def _prepare(runner, wake_from: str) -> Asleep:
    """What sleep will drop, and (GPU) the pinned copies of what wake cannot read from the files: every model storage
    with wake_from 'host'; the tensors computed at install (rotary tables) either way."""
    if wake_from not in WAKE_FROM:
        raise ValueError(f"wake_from must be one of {WAKE_FROM}, got {wake_from!r}")
    named = _file_names(runner)
    kind = runner.device_kind
    frees = kind.sleep_frees_storages
    # a CPU rank keeps what the files do not hold (rotary tables: small, and the native stack points at them)
    extra = list(runner.model.buffers()) if frees else []
    weights = _storages(list(named.values()) + extra)
    file_ptrs = {t.untyped_storage().data_ptr() for t in named.values()}
    file_backed = [wake_from == "files" and t.untyped_storage().data_ptr() in file_ptrs for t, _ in weights]
    state = Asleep(wake_from, weights, file_backed, _storages(_kv_tensors(runner)))
    if frees:
        offsets, total = {}, 0
        for i, ((_, nbytes), from_file) in enumerate(zip(weights, file_backed)):
            if not from_file:
                offsets[i] = total
                total += -(-nbytes // HOST_ALIGN) * HOST_ALIGN
        state.arena = kind.pinned_host_arena(total) if total else None
        for i, at in offsets.items():
            t, nbytes = weights[i]
            state.host[i] = state.arena.bytes[at:at + nbytes]
            state.host[i].copy_(_bytes_of(t), non_blocking=True)
        kind.synchronize()
    elif not all(file_backed):
        raise DeviceMemError("a CPU rank's weights are host memory already: sleep releases them and wake reads the "
                             "model files again (wake_from='files')")
    return state


def _restore(runner, state: Asleep) -> None:
    frees = runner.device_kind.sleep_frees_storages
    if frees:
        for t, nbytes in state.weights + state.kv:
            t.untyped_storage().resize_(nbytes)
        for i, host in state.host.items():
            _bytes_of(state.weights[i][0]).copy_(host, non_blocking=True)
        for t, _ in state.kv:
            _bytes_of(t).zero_()
    if any(state.file_backed):
        named = _file_names(runner)
        read_rank_state(runner.model_file, runner.tp, runner.model, lambda specs: {n: named[n] for n in specs})
    if frees:
        runner.capture_graphs()
        runner.device_kind.synchronize()


def _reasons(comm, errors: list) -> str:
    return "; ".join(f"rank {r}: {e}" if comm.world_size > 1 else e for r, e in enumerate(errors) if e)


def sleep(runner, wake_from: str, comm) -> None:
    """Collective: free this rank's weights, KV cache and graphs (the caller ended every request first). If any rank
    fails to prepare, none sleeps and each raises DeviceMemError."""
    state, error = None, None
    try:
        state = _prepare(runner, wake_from)
    except Exception as e:   # told to every rank below, so that all stay awake together
        error = f"{type(e).__name__}: {e}"
    errors = comm.allgather_obj(error)
    if any(errors):
        raise DeviceMemError(f"cannot sleep: {_reasons(comm, errors)}")
    _release(runner, state)
    runner.asleep = state
    log.info("asleep: %.1f MiB of weights (wake from %s), %.1f MiB of KV cache released",
             sum(n for _, n in state.weights) / 2**20, wake_from, sum(n for _, n in state.kv) / 2**20)


def _file_change(runner, state: Optional[Asleep]) -> Optional[str]:
    """Where wake reads the model files: how the weights file changed since the install (None: it did not)."""
    if state is None or not any(state.file_backed):
        return None
    try:
        return weights_changed(runner.model_file)
    except OSError as e:
        return f"cannot read the weights file {runner.model_file.weights_path!r}: {e}"


def wake(runner, comm) -> None:
    """Collective: restore what sleep freed. If any rank fails (a GPU whose memory was taken meanwhile), every rank
    goes back to sleep, keeping what it needs to try again, and raises DeviceMemError."""
    state: Optional[Asleep] = runner.asleep
    error = None if state is not None else "the model is not asleep on this rank"
    changes = comm.allgather_obj(_file_change(runner, state))   # any rank's file changed: none reads, all sleep on
    if any(changes):
        raise WeightsChangedError(f"cannot wake: {_reasons(comm, changes)}. Wake reads the weights from the model "
                                  f"files again and refuses others than the installed ones, so the model stays asleep: "
                                  f"put the installed file back and call load_device_mem again, or release the model "
                                  f"and install the new files")
    try:
        if state is not None:
            _restore(runner, state)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    errors = comm.allgather_obj(error)
    if any(errors):
        if state is not None:
            _release(runner, state)
        raise DeviceMemError(f"cannot wake: {_reasons(comm, errors)}")
    runner.asleep = None
    state.host.clear()
    state.arena = None      # unpinned, then freed (back to the OS: one large allocation)
