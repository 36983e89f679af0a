"""Micro-benchmark: the allreduce of one decode step's activations between 2 GPUs, as a tensor-parallel pool does it
twice per layer: NCCL (torch.distributed) against allspark's one-shot kernel over peer memory
(allspark_server/cuda/peer_allreduce.py, both protocols: sentinel values and flags) and PyTorch's symmetric-memory
one-shot allreduce (each GPU reads the other's buffer over NVLink; no multicast), each captured in a CUDA graph of
`--calls` allreduces, as in a decode graph. Checks each result against the exact sum, then times graph replays.

    PYTHONPATH=. python benchmarks/allreduce_micro.py [--rows 1 8 128] [--hidden 4096] [--calls 64] [--json PATH]

Spawns one process per GPU (2 GPUs needed). NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def graph_of(fn, warm: int = 3) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_us(g: torch.cuda.CUDAGraph, calls: int, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def every_rank(ok: bool) -> bool:
    """True if `ok` on every rank (an allreduce of the flags)."""
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def in_place_row(row: dict, name: str, allreduce_, t: torch.Tensor, x: torch.Tensor, expect: torch.Tensor,
                 calls: int) -> None:
    """`calls` times t = x, allreduce_(t), captured in one graph: the result's error against `expect` and the
    microseconds a call, into row[name + '_err'] and row[name + '_us']."""
    def body():
        for _ in range(calls):
            t.copy_(x)
            allreduce_(t)
    g = graph_of(body)
    g.replay()
    torch.cuda.synchronize()
    row[f"{name}_err"] = (t.float() - expect).abs().max().item()
    row[f"{name}_us"] = replay_us(g, calls)


def worker(rank: int, world: int, args, out_path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    from allspark_server.compute.cuda import peer_allreduce
    group = dist.group.WORLD
    peers = {protocol: peer_allreduce.start(torch.device("cuda", rank), rank, world, group.group_name, every_rank,
                                            protocol=protocol) for protocol in peer_allreduce.PROTOCOLS}
    results = {}
    for rows in args.rows:
        shape = (rows, args.hidden)
        x = (torch.arange(rows * args.hidden, device="cuda", dtype=torch.float32).reshape(shape) % 97 * (rank + 1)
             / 64).to(torch.bfloat16)
        expect = sum((torch.arange(rows * args.hidden, device="cuda", dtype=torch.float32).reshape(shape) % 97
                      * (r + 1) / 64) for r in range(world))
        row = {}
        t = x.clone()
        in_place_row(row, "nccl", dist.all_reduce, t, x, expect, args.calls)
        for protocol, peer in peers.items():   # allspark's one-shot kernel over peer memory, in place
            if peer is not None and peer.fits(x):
                in_place_row(row, f"peer_{protocol}", peer.allreduce_, t, x, expect, args.calls)
        # symmetric memory one-shot: x copied into the registered buffer, the sum written to `out`
        try:
            buf = symm_mem.empty(shape, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(buf, group.group_name)
            out = torch.empty_like(x)

            def one_shot():
                for _ in range(args.calls):
                    buf.copy_(x)
                    torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group.group_name, out)
            g = graph_of(one_shot)
            g.replay()
            torch.cuda.synchronize()
            row["one_shot_err"] = (out.float() - expect).abs().max().item()
            row["one_shot_us"] = replay_us(g, args.calls)
            if hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
                def one_shot_copy():
                    for _ in range(args.calls):
                        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", group.group_name, out)
                g = graph_of(one_shot_copy)
                g.replay()
                torch.cuda.synchronize()
                row["one_shot_copy_err"] = (out.float() - expect).abs().max().item()
                row["one_shot_copy_us"] = replay_us(g, args.calls)

            def two_shot():
                for _ in range(args.calls):
                    buf.copy_(x)
                    torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group.group_name)
            g = graph_of(two_shot)
            g.replay()
            torch.cuda.synchronize()
            row["two_shot_err"] = (buf.float() - expect).abs().max().item()
            row["two_shot_us"] = replay_us(g, args.calls)
        except Exception as e:   # what failed, in the report
            row["symm_mem_error"] = repr(e)[:500]
        # a plain copy of the same size, the floor for any allreduce that stages its input
        def copies():
            for _ in range(args.calls):
                t.copy_(x)
        row["copy_only_us"] = replay_us(graph_of(copies), args.calls)
        results[str(rows)] = row
    if rank == 0:
        report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "hidden": args.hidden,
                  "calls_per_graph": args.calls, "rows": results}
        print(json.dumps(report, indent=1), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--json", default=None, help="default: benchmarks/results/allreduce-<machine>.json")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    args.json = args.json or common.result_path("allreduce", "cuda")
    mp.spawn(worker, args=(2, args, args.json), nprocs=2, join=True)


if __name__ == "__main__":
    main()
