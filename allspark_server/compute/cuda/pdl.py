"""Programmatic dependent launch (PDL, sm_90+) for the decode step's Triton kernels: a kernel may start while the
one before it in the stream is still finishing, so the launch gap and the last wave's idle SMs between two
kernels are filled, and a GEMV streams its first weight tile while the norm or attention before it runs.

The contract every kernel launched with `launch_options(device)` keeps (its PDL constexpr on):
  1. `allow_next(PDL)` first: the next kernel may launch once every program of this one has reached it;
  2. `wait_for_previous(PDL)` before it reads or writes anything an earlier kernel writes or reads
     (activations, the span cache, its own output buffer): it returns once the kernel before has completed and
     its writes are visible. Only memory no kernel of the step writes is read before it: weights, their scales,
     and inputs the step's host-to-device copies wrote before its first kernel (a LoRA row's adapter slot).
Since each kernel completes only after its wait, a kernel past its wait has every earlier kernel complete behind
it; torch's, cuBLAS's and NCCL's launches carry no flag and wait for completion as always. The flag is part of
a CUDA graph's capture (programmatic edges). ALLSPARK_PDL=0 launches everything without it (A/B runs); the
interpreter never sees it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from allspark_client import settings


@triton.jit
def allow_next(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


_INTERPRETED = not isinstance(allow_next, triton.JITFunction)      # decorated under TRITON_INTERPRET=1


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: a GPU of compute capability 9.0 or newer, compiled kernels (not
    the interpreter), and ALLSPARK_PDL not 0."""
    if _INTERPRETED or device.type != "cuda" or not settings.PDL.get():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a PDL-aware kernel's launch takes: its PDL constexpr and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
