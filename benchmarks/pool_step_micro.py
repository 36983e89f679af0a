"""Micro-benchmark: one decode step of a tensor-parallel pool of GPU ranks on the GPUs alone (a diagnostic for
`cuda_bench.py`'s 2-GPU pool rows: what the ranks' graphs cost without the host's scheduling and messages).

    mpirun -n 2 python benchmarks/pool_step_micro.py GRAPH WEIGHTS OUT_JSON [--batch 1] [--repeats 50]

Each rank installs its shard of the serialized model (install_runner: NCCL set up, decode graphs captured with
the allreduces and the LM-head gather inside), then both replay their batch-B graph together, timed by CUDA
events on each rank. Rank 0 writes every rank's milliseconds per replay.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from cuda_common import graph_replay_ms

from allspark_client.config import AsModelRuntimeConfigBuilder
from allspark_client.types import TargetDevice
from allspark_server.collective.comm import get_comm
from allspark_server.runner.model_runner import install_runner


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("graph")
    p.add_argument("weights")
    p.add_argument("out_json")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="also rank 0's kernels of 10 replays, by total time")
    a = p.parse_args(argv)
    comm = get_comm()
    cfg = (AsModelRuntimeConfigBuilder().model_name("micro").model_file_path(a.graph, a.weights)
           .compute_unit(TargetDevice.CUDA, list(range(comm.world_size))).max_length(256).max_batch(a.batch)
           .kv_cache_span_size(32).build())
    runner = install_runner(cfg, comm)
    graph = runner.graphs.graphs[a.batch]
    times = []
    for _ in range(5):   # five timed series; the ranks meet at a barrier before each
        comm.barrier()
        times.append(graph_replay_ms(runner.graphs, a.batch, a.repeats))
    every = comm.allgather_obj(statistics.median(times))
    report = {"ranks": comm.world_size, "batch": a.batch, "graph_replay_ms_by_rank": every,
              "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    if a.profile:
        comm.barrier()
        report["kernels_ms_per_step"] = profiled_kernels(graph, comm.rank == 0)
    if comm.rank == 0:
        with open(a.out_json, "w") as f:
            json.dump(report, f)
        print(f"pool of {comm.world_size} GPU ranks, batch {a.batch}: graph replay ms by rank {every}", flush=True)


def profiled_kernels(graph, profiled: bool, replays: int = 10) -> list:
    """[(kernel name, ms per replay, launches per replay)] of `replays` replays, by total time (on the rank that
    profiles; the others replay alongside, so that the collectives meet)."""
    from torch.profiler import ProfilerActivity, profile
    if not profiled:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:90], round(e.device_time_total / 1e3 / replays, 4), e.count / replays) for e in rows]


if __name__ == "__main__":
    main()
