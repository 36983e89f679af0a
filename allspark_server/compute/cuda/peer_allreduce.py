"""One-shot allreduce of small activations between the GPUs of one host, over peer memory (NVLink or PCIe P2P).

A decode step of a tensor-parallel pool allreduces two [batch, hidden] rows per layer. At batch 1 that is 8 KB,
and NCCL's allreduce there is all latency: about 8 µs a call inside a CUDA graph, 64 calls in a 7B step. Every
rank holds one buffer in symmetric memory (torch.distributed._symmetric_memory: each rank can address every
rank's buffer), and a call is one launch. Two protocols (ALLSPARK_PEER_ALLREDUCE_PROTOCOL):

- "sentinel" (the default; TensorRT-LLM's low-latency allreduce works this way): per slot, the buffer holds a region
  for each rank whose elements read -0.0 until data arrives. A call writes its chunk straight into its own region
  of every peer's buffer, spins on its own buffer until no element of the chunk is -0.0, sums in rank order and
  writes -0.0 back. Senders turn -0.0 into +0.0, the same value in any sum. 2- and 4-byte dtypes have separate
  areas (their sentinels differ). `allreduce_norm` also adds the residual and applies the RMSNorm that follows
  the sum (fused_kernels.rms_norm's math), a program per row.
- "flags": each program copies its chunk into its own buffer's slot, raises its flag (chunk, slot, own rank) in
  every peer's flag area (release, system scope), waits for every peer's flag in its own area and lowers it
  (acquire), then reads the peers' chunks.

The sentinel protocol is one one-way trip over the link where the flags take a write, a remote atomic and a remote
read (benchmarks/results/allreduce-h200x2.json, pool-step-h200x2.json). Both sum in rank order, so every rank gets
the same bits. A call takes the slot that a counter on the GPU names (flipped by the call's last program), and
consecutive calls alternate the slots: a peer writes into a slot again (or raises its flags there) only two calls
later, which it reaches only after this rank has read and reset it. Every rank must make the same sequence of calls
(a pool's ranks run the same steps). Tensors of more than MAX_PROGRAMS x BLOCK elements go to NCCL (comm.py
decides). CUDA-graph safe: no launch reads tensor contents on the host.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.fused_kernels import _INTERPRETED, _normed_row, _round, norm_outputs, norm_warps
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous

log = logging.getLogger(__name__)

BLOCK = 1024             # elements a program moves
MAX_PROGRAMS = 64        # chunks of one call: calls of up to MAX_PROGRAMS * BLOCK elements take this path
FLAG_BYTES = 2 * MAX_PROGRAMS * 8 * 4   # int32 flags [slot][program][source rank], up to 8 ranks
PROTOCOLS = ("sentinel", "flags")
MAX_NORM_COLUMNS = 16384   # rows this wide at most take the allreduce and the norm in one program each
# the sentinel protocol's areas, one per element size: the int of that size, whose minimum has -0.0's bits
SENTINEL_INTS = {2: (torch.int16, tl.int16), 4: (torch.int32, tl.int32)}


@triton.jit
def _next_slot(slot_of_call, done, slot):
    if tl.atomic_add(done, 1) == tl.num_programs(0) - 1:   # the last program: the next call takes the other slot
        tl.store(slot_of_call, 1 - slot)
        tl.store(done, 0)


@triton.jit
def _peer_allreduce_kernel(x, n, buffers, slot_of_call, done, data_start, slot_elems,
                           RANK: tl.constexpr, WORLD: tl.constexpr, MAXP: tl.constexpr, BLOCK: tl.constexpr,
                           SOFT_BF16: tl.constexpr):
    """Program = one chunk of BLOCK elements of x; `buffers` [WORLD] int64: each rank's symmetric buffer (int32
    flags first, then from element data_start (in x's dtype) the two slots of slot_elems elements)."""
    pid = tl.program_id(0)
    slot = tl.load(slot_of_call)                           # every program reads it before the last one flips it
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    mine = tl.load(x + offs, mask=ok, other=0.0)
    data = data_start + slot * slot_elems
    own = tl.multiple_of(tl.load(buffers + RANK).to(tl.pointer_type(x.dtype.element_ty)), 16)
    tl.store(own + data + offs, mine, mask=ok)
    tl.debug_barrier()                                      # the whole chunk is written before the flag goes up
    flag = (slot * MAXP + pid) * WORLD
    for p in tl.static_range(WORLD):
        if p != RANK:
            theirs = tl.load(buffers + p).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(theirs + flag + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    own_flags = tl.load(buffers + RANK).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != RANK:
            while tl.atomic_cas(own_flags + flag + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()                                      # no thread reads a peer's chunk before its flag
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):                        # in rank order: the same bits on every rank
        if p == RANK:
            total += mine.to(tl.float32)
        else:
            peer = tl.multiple_of(tl.load(buffers + p).to(tl.pointer_type(x.dtype.element_ty)), 16)
            total += tl.load(peer + data + offs, mask=ok, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.store(x + offs, _round(total, x.dtype.element_ty, SOFT_BF16).to(x.dtype.element_ty), mask=ok)
    _next_slot(slot_of_call, done, slot)


@triton.jit
def _sentinel_sum(x, offs, ok, buffers, slot, area_start, region_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                  BLOCK: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """The fp32 sum over the ranks, in rank order, of x[offs]: sent into every peer's buffer, the peers' read
    from this rank's own (their elements reset after)."""
    mine = tl.load(x + offs, mask=ok, other=0.0)
    bits = mine.to(BITS, bitcast=True)                     # -0.0 would read as "not arrived": send +0.0
    mine = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits).to(x.dtype.element_ty, bitcast=True)
    base = area_start + slot * WORLD * region_elems
    for p in tl.static_range(WORLD):
        if p != RANK:
            theirs = tl.multiple_of(tl.load(buffers + p).to(tl.pointer_type(x.dtype.element_ty)), 16)
            tl.store(theirs + base + RANK * region_elems + offs, mine, mask=ok)
    own = tl.multiple_of(tl.load(buffers + RANK).to(tl.pointer_type(x.dtype.element_ty)), 16)
    sentinel = tl.full([BLOCK], SENTINEL, BITS).to(x.dtype.element_ty, bitcast=True)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):                        # in rank order: the same bits on every rank
        if p == RANK:
            total += mine.to(tl.float32)
        else:
            src = own + base + p * region_elems + offs
            v = tl.load(src, mask=ok, other=0.0, volatile=True)
            while tl.max((v.to(BITS, bitcast=True) == SENTINEL).to(tl.int32), axis=0) > 0:
                v = tl.load(src, mask=ok, other=0.0, volatile=True)
            total += v.to(tl.float32)
            tl.store(src, sentinel, mask=ok)                # ready for this slot's next call
    return total


@triton.jit
def _sentinel_allreduce_kernel(x, n, buffers, slot_of_call, done, area_start, region_elems,
                               RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                               BITS: tl.constexpr, SENTINEL: tl.constexpr, SOFT_BF16: tl.constexpr,
                               PDL: tl.constexpr):
    """Program = one chunk of BLOCK elements of x, summed in place; `buffers` [WORLD] int64: each rank's symmetric
    buffer, whose area for x's element size starts at element area_start: [slot][source rank][region_elems]."""
    allow_next(PDL)
    wait_for_previous(PDL)                                 # x, and the slot the call before flipped
    slot = tl.load(slot_of_call)                           # every program reads it before the last one flips it
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    total = _sentinel_sum(x, offs, ok, buffers, slot, area_start, region_elems, RANK, WORLD, BLOCK, BITS, SENTINEL)
    tl.store(x + offs, _round(total, x.dtype.element_ty, SOFT_BF16).to(x.dtype.element_ty), mask=ok)
    _next_slot(slot_of_call, done, slot)


@triton.jit
def _sentinel_allreduce_norm_kernel(x, residual, weight, out, s_out, eps, H, stride_r, buffers, slot_of_call, done,
                                    area_start, region_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                                    BLOCK: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr,
                                    SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program = one row of x [rows, H] (contiguous): its sum over the ranks rounded to x's dtype (what the plain
    call leaves in x), then fused_kernels.rms_norm with the residual add: s = sum + residual, out = weight *
    rmsnorm(s), each rounded as there."""
    allow_next(PDL)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)                          # [BLOCK]
    wait_for_previous(PDL)
    slot = tl.load(slot_of_call)
    row = tl.program_id(0).to(tl.int64)
    total = _sentinel_sum(x, row * H + cols, ok, buffers, slot, area_start, region_elems, RANK, WORLD, BLOCK, BITS,
                          SENTINEL)
    r = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    s = _round(_round(total, x.dtype.element_ty, SOFT_BF16) + r, s_out.dtype.element_ty, SOFT_BF16)
    tl.store(s_out + row * H + cols, s.to(s_out.dtype.element_ty), mask=ok)
    y = _normed_row(s, w, eps, H, s_out.dtype.element_ty, out.dtype.element_ty, SOFT_BF16)
    tl.store(out + row * H + cols, y.to(out.dtype.element_ty), mask=ok)
    _next_slot(slot_of_call, done, slot)


class PeerAllreduce:
    """The symmetric buffers of this rank and the launch; `buffers` [world] int64 addresses on this GPU."""

    def __init__(self, buffers: torch.Tensor, rank: int, world: int, slot_bytes: int, keep=None,
                 protocol: str = "sentinel"):
        if world > 8:
            raise ValueError(f"peer allreduce takes up to 8 ranks, not {world}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"peer allreduce protocol {protocol!r}: one of {PROTOCOLS}")
        self.buffers, self.rank, self.world, self.slot_bytes = buffers, rank, world, slot_bytes
        self.protocol = protocol
        self.slot = torch.zeros(1, dtype=torch.int32, device=buffers.device)   # the next call's slot
        self.done = torch.zeros(1, dtype=torch.int32, device=buffers.device)
        self._keep = keep                      # what owns the memory behind `buffers`

    @staticmethod
    def buffer_bytes(slot_bytes: int, world: int = 8, protocol: str = "sentinel") -> int:
        if protocol == "flags":
            return FLAG_BYTES + 2 * slot_bytes
        return len(SENTINEL_INTS) * 2 * world * slot_bytes   # an area per element size: [slot][rank][slot_bytes]

    @staticmethod
    def clear(buffer: torch.Tensor, world: int, slot_bytes: int, protocol: str = "sentinel") -> None:
        """A fresh buffer (uint8) made ready: flags lowered, or every area's elements set to its -0.0."""
        if protocol == "flags":
            buffer.zero_()
            return
        area = 2 * world * slot_bytes
        for i, (bits, _) in enumerate(SENTINEL_INTS.values()):
            buffer[i * area:(i + 1) * area].view(bits).fill_(torch.iinfo(bits).min)

    def fits(self, t: torch.Tensor) -> bool:
        return (t.is_contiguous() and t.numel() <= MAX_PROGRAMS * BLOCK
                and t.numel() * t.element_size() <= self.slot_bytes
                and (self.protocol == "flags" or t.element_size() in SENTINEL_INTS))

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place (every rank calls it with the same shape and dtype)."""
        n, size = t.numel(), t.element_size()
        grid = (triton.cdiv(n, BLOCK),)
        if self.protocol == "flags":
            _peer_allreduce_kernel[grid](
                t, n, self.buffers, self.slot, self.done, FLAG_BYTES // size, self.slot_bytes // size,
                RANK=self.rank, WORLD=self.world, MAXP=MAX_PROGRAMS, BLOCK=BLOCK, SOFT_BF16=_INTERPRETED,
                num_warps=4)
            return t
        _sentinel_allreduce_kernel[grid](
            t, n, self.buffers, self.slot, self.done, *self._area(t),
            RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, **self._sentinel(t), **pdl.launch_options(t.device))
        return t

    def allreduce_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """fused_kernels.rms_norm(t summed over the ranks, weight, eps, residual) in one launch: (out, s); None where
        this call cannot (the flags protocol, rows too wide or too many). t itself is left as it was."""
        if t.dim() != 2:
            return None
        rows, h = t.shape
        if (self.protocol != "sentinel" or not self.fits(t) or h > MAX_NORM_COLUMNS or residual.shape != t.shape
                or residual.stride(-1) != 1 or weight.shape != (h,) or not weight.is_contiguous()):
            return None
        out, s = norm_outputs(t, residual, weight)
        if rows:
            block = triton.next_power_of_2(h)
            _sentinel_allreduce_norm_kernel[(rows,)](
                t, residual, weight, out, s, eps, h, residual.stride(0), self.buffers, self.slot, self.done,
                *self._area(t), RANK=self.rank, WORLD=self.world, BLOCK=block, **self._sentinel(t),
                num_warps=norm_warps(block), enable_fp_fusion=False, **pdl.launch_options(t.device))
        return out, s

    def _area(self, t: torch.Tensor) -> tuple[int, int]:
        """(where the area of t's element size starts, elements of a rank's region), in t's elements."""
        size = t.element_size()
        return list(SENTINEL_INTS).index(size) * 2 * self.world * self.slot_bytes // size, self.slot_bytes // size

    @staticmethod
    def _sentinel(t: torch.Tensor) -> dict:
        bits, tl_bits = SENTINEL_INTS[t.element_size()]
        return dict(BITS=tl_bits, SENTINEL=torch.iinfo(bits).min, SOFT_BF16=_INTERPRETED)


def start(device: torch.device, rank: int, world: int, group_name: str, agree: Callable[[bool], bool],
          slot_bytes: int = MAX_PROGRAMS * BLOCK * 4, protocol: str = "sentinel") -> Optional[PeerAllreduce]:
    """Collective: the symmetric buffers of every rank, checked with one allreduce of known values; None (NCCL
    then) where symmetric memory is missing or the check fails on any rank. `agree(ok)`: True if every rank's ok
    is (over MPI)."""
    peer, why = None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        mem = symm_mem.empty(PeerAllreduce.buffer_bytes(slot_bytes, world, protocol), dtype=torch.uint8,
                             device=device)
        PeerAllreduce.clear(mem, world, slot_bytes, protocol)
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(mem, group_name)
        buffers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        peer = PeerAllreduce(buffers, rank, world, slot_bytes, keep=(mem, handle), protocol=protocol)
    except Exception as e:   # no symmetric memory here (an old torch, no P2P between the GPUs)
        why = f"{type(e).__name__}: {e}"
    if not agree(peer is not None):
        log.info("allreduce between GPUs: NCCL (peer memory: %s)", why or "not on every rank")
        return None
    ok = self_check(peer, device)
    if not agree(ok):
        log.warning("allreduce between GPUs: NCCL (the peer-memory allreduce's check failed on a rank)")
        return None
    log.info("allreduce between GPUs: peer memory (%s) for up to %d elements a call, NCCL beyond", protocol,
             MAX_PROGRAMS * BLOCK)
    return peer


def self_check(peer: PeerAllreduce, device: torch.device) -> bool:
    """A few allreduces of values whose sums are exact, in both slots and over several programs (and one with the
    norm after it)."""
    try:
        calls = [(1, 1, torch.bfloat16), (4096, 1, torch.bfloat16), (3 * BLOCK + 7, 1, torch.float32),
                 (4096, -0.0, torch.bfloat16), (4096, 1, torch.float16)]
        for n, scale, dtype in calls:   # -0.0 on every rank: the sentinel protocol's sender must not send it
            x = torch.full((n,), scale * (peer.rank + 1), dtype=dtype, device=device)
            peer.allreduce_(x)
            want = scale * peer.world * (peer.world + 1) / 2
            if not bool((x == want).all()):
                return False
        if peer.protocol == "sentinel":   # the sum with the norm: s = sum + 1 exactly, and s normed is 1 (bf16)
            x = torch.full((2, 4096), float(peer.rank + 1), dtype=torch.bfloat16, device=device)
            ones = torch.ones_like(x)
            normed, s = peer.allreduce_norm(x, ones, ones[0], 1e-6)
            if not bool((s == peer.world * (peer.world + 1) / 2 + 1).all() and (normed == 1).all()):
                return False
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except Exception:
        log.exception("peer allreduce check")
        return False
