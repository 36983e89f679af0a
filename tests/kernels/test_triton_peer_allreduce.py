"""The one-shot allreduce over peer memory (allspark_server/cuda/peer_allreduce.py) that GPU ranks of one host use
for a decode step's activations, run in Triton's interpreter: one process per rank, the ranks' buffers in shared
memory standing for the GPUs' symmetric memory, for both protocols (flags; sentinel values). Checked against the
fp32 sum in rank order rounded once to the dtype (what the kernel promises), with the same bits on every rank, over
a sequence of calls of changing shapes and dtypes (the two slots alternate, several programs a call, -0.0 sent),
and the flags, sentinels and counters it leaves."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from allspark_server.compute.cuda import peer_allreduce as pa

CALLS = [((1, 4096), torch.bfloat16), ((5,), torch.bfloat16), ((3, 1000), torch.float16),
         ((2, 4096), torch.float32), ((1, 4096), torch.bfloat16), ((1, 4096), torch.bfloat16),
         ((7,), torch.float32), ((4, 2048 + 3), torch.bfloat16), ((1, 64), torch.float16)]   # odd: ends on slot 1
SLOT_BYTES = 4 * 4096 * 4     # room for the largest call above in fp32


def fresh_buffer(world: int, protocol: str) -> torch.Tensor:
    buffer = torch.empty(pa.PeerAllreduce.buffer_bytes(SLOT_BYTES, world, protocol), dtype=torch.uint8)
    pa.PeerAllreduce.clear(buffer, world, SLOT_BYTES, protocol)
    return buffer


def run_ranks(world: int, calls, protocol: str, timeout_s: float = 240.0):
    """Every rank's inputs and outputs of `calls`, the ranks in spawned processes; and their final buffers."""
    g = torch.Generator().manual_seed(world)
    inputs = [[(torch.randn(shape, generator=g) * (r + 1)).to(dtype) for shape, dtype in calls] for r in range(world)]
    for r in range(world):   # zeros of both signs among the values: -0.0 is the sentinel protocol's "not arrived"
        inputs[r][0].view(-1)[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0 if r else -0.0])
    outputs = [[torch.full(shape, float("nan"), dtype=dtype).share_memory_() for shape, dtype in calls]
               + [torch.full((2,), -1, dtype=torch.int64).share_memory_()] for _ in range(world)]
    return inputs, outputs, run_ranks_with(world, inputs, outputs, protocol, timeout_s)


def run_ranks_with(world: int, inputs: list, outputs: list, protocol: str, timeout_s: float = 240.0) -> list:
    """The ranks' calls of `inputs` in spawned processes, results into the shared `outputs`: the final buffers."""
    import peer_allreduce_ranks
    return spawn_ranks(world, protocol, peer_allreduce_ranks.run_rank,
                       lambda r: (inputs[r], outputs[r], protocol), timeout_s)


# what a rank process imports, done once in the fork server that the ranks are forked from (a fresh interpreter's
# torch, Triton and kernels each time took seconds a rank)
RANK_PRELOAD = ["peer_allreduce_ranks", "torch", "triton_interpreter", "allspark_server.compute.cuda.peer_allreduce",
                "allspark_server.compute.cuda.fused_kernels"]


def spawn_ranks(world: int, protocol: str, target, rank_args, timeout_s: float = 240.0) -> list:
    """target(rank, world, buffers, SLOT_BYTES, *rank_args(rank)) in a process of its own per rank, forked from a
    fork server that has imported RANK_PRELOAD (peer_allreduce_ranks first: it sets TRITON_INTERPRET): the
    buffers."""
    mp = torch.multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(RANK_PRELOAD)
    buffers = [fresh_buffer(world, protocol).share_memory_() for _ in range(world)]
    procs = [mp.Process(target=target, args=(r, world, buffers, SLOT_BYTES, *rank_args(r)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, f"ranks {hung} still waiting after {timeout_s} s (a flag never raised)"
    assert [p.exitcode for p in procs] == [0] * world
    return buffers


@pytest.mark.parametrize("protocol", pa.PROTOCOLS)
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum_over_a_sequence_of_calls(world, protocol):
    inputs, outputs, buffers = run_ranks(world, CALLS, protocol)
    for i, (shape, dtype) in enumerate(CALLS):
        total = torch.zeros(shape, dtype=torch.float32)
        for r in range(world):                     # fp32, in rank order, rounded once
            total += inputs[r][i].float()
        want = total.to(dtype)
        for r in range(world):
            assert torch.equal(outputs[r][i], want), f"call {i} ({shape}, {dtype}) on rank {r}"
    for r in range(world):
        # every call flipped the slot once (the slots alternate), and its last program reset the arrivals
        assert outputs[r][-1].tolist() == [len(CALLS) % 2, 0]
        if protocol == "flags":   # every flag raised was lowered by the rank it was meant for
            flags = buffers[r][:pa.FLAG_BYTES].view(torch.int32)
            assert int(flags.count_nonzero()) == 0
        else:                     # every element written was set back to -0.0 by the rank it was meant for
            assert torch.equal(buffers[r], fresh_buffer(world, protocol))


NORM_CALLS = [((1, 4096), torch.bfloat16, "norm"), ((5,), torch.bfloat16, "plain"), ((3, 1000), torch.float16, "norm"),
              ((2, 576), torch.float32, "norm"), ((1, 4096), torch.bfloat16, "norm")]


def test_the_sum_and_the_next_norm_in_one_launch():
    """allreduce_norm between plain calls: s = (the rank-order fp32 sum rounded) + residual, rounded; the normed
    row as the torch reference norms s (fp32 math, RMSNorm's mean in its own order: within one rounding), and
    bit-equal to the plain call then fused_kernels.rms_norm (in the rank's process: interpreted), on every rank."""
    from allspark_server.compute.reference import rms_norm_reference
    world, g = 2, torch.Generator().manual_seed(5)
    shared = {i: ((torch.randn(shape, generator=g) * 3).to(dtype), (torch.rand(shape[-1], generator=g) + 0.5).to(dtype))
              for i, (shape, dtype, kind) in enumerate(NORM_CALLS) if kind == "norm"}   # residual, weight: alike
    parts = [[(torch.randn(shape, generator=g) * (r + 1)).to(dtype) for shape, dtype, _ in NORM_CALLS]
             for r in range(world)]
    inputs = [[(x, *shared[i], 1e-5) if i in shared else x for i, x in enumerate(xs)] for xs in parts]
    outputs = [[tuple(torch.empty(shape, dtype=dtype).share_memory_() for _ in range(3))
                if kind == "norm" else torch.empty(shape, dtype=dtype).share_memory_()
                for shape, dtype, kind in NORM_CALLS] + [torch.full((2,), -1, dtype=torch.int64).share_memory_()]
               for _ in range(world)]
    buffers = run_ranks_with(world, inputs, outputs, "sentinel")
    for i, (shape, dtype, kind) in enumerate(NORM_CALLS):
        total = sum(parts[r][i].float() for r in range(world)).to(dtype)
        if kind == "plain":
            assert all(torch.equal(outputs[r][i], total) for r in range(world)), f"call {i}"
            continue
        residual, weight = shared[i]
        stream = (total.float() + residual.float()).to(dtype)
        want, _ = rms_norm_reference(total, weight, 1e-5, residual)
        for r in range(world):
            normed, s, same = outputs[r][i]
            assert torch.equal(s, stream), f"call {i} rank {r}: the residual stream"
            assert torch.equal(normed, same), f"call {i} rank {r}: not the plain call's norm"
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1e-3)
            assert ((normed.float() - want.float()).abs() <= ulp).all(), f"call {i} rank {r}"
    for r in range(world):   # a norm call is two calls here (fused, then plain)
        assert outputs[r][-1].tolist() == [(len(NORM_CALLS) + len(shared)) % 2, 0]
        assert torch.equal(buffers[r], fresh_buffer(world, "sentinel"))


@pytest.mark.parametrize("protocol", pa.PROTOCOLS)
def test_the_start_check_passes_on_both_protocols(protocol):
    import peer_allreduce_ranks
    results = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(2)]
    spawn_ranks(2, protocol, peer_allreduce_ranks.check_rank, lambda r: (protocol, results[r]))
    assert [int(r) for r in results] == [1, 1]


def test_allreduce_norm_declines_what_it_cannot_take():
    slot = 64 * 1024 * 4
    peer = pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, slot)
    x = torch.zeros(2, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    flags = pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, slot, protocol="flags")
    assert flags.allreduce_norm(x, x, w, 1e-6) is None                                   # no norm in that kernel
    assert peer.allreduce_norm(x.view(-1), x.view(-1), w, 1e-6) is None                  # rows of H wanted
    assert peer.allreduce_norm(x, x, w[:4095], 1e-6) is None                             # weight of another width
    assert peer.allreduce_norm(x, torch.zeros(4096, 2, dtype=torch.bfloat16).t(), w, 1e-6) is None   # strided rows
    wide = torch.zeros(1, 32768, dtype=torch.bfloat16)
    assert peer.allreduce_norm(wide, wide, torch.ones(32768, dtype=torch.bfloat16), 1e-6) is None   # too wide


def test_what_fits_the_peer_path():
    slot = 64 * 1024 * 4
    peer = pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, slot)
    assert peer.fits(torch.empty(1, 4096, dtype=torch.bfloat16))
    assert peer.fits(torch.empty(16, 4096, dtype=torch.float32))            # 64 programs of 1024, 256 KiB
    assert not peer.fits(torch.empty(17, 4096, dtype=torch.bfloat16))       # more programs than flags
    assert not peer.fits(torch.empty(8, 4096, dtype=torch.float32)[:, ::2])  # not contiguous
    small = pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, 4096)
    assert not small.fits(torch.empty(2048, dtype=torch.float32))          # 8 KiB > the 4 KiB slot
    with pytest.raises(ValueError, match="up to 8 ranks"):
        pa.PeerAllreduce(torch.zeros(9, dtype=torch.int64), 0, 9, slot)
    assert not peer.fits(torch.empty(4, dtype=torch.float64))                # no sentinel area for 8-byte elements
    assert pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, slot, protocol="flags").fits(
        torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="protocol 'bits'"):
        pa.PeerAllreduce(torch.zeros(2, dtype=torch.int64), 0, 2, slot, protocol="bits")
