"""Run under mpirun: overlapped scheduling across a 2-rank pool, on the CPU.

    mpirun -n 2 python tests/mpi/overlap_pool.py GRAPH WEIGHTS REQUESTS_JSON OUT_JSON

Every rank's runner gets the eager stand-in for the CUDA decode graphs (tests/eager_graphs.py), so rank 0 plans
decode steps ahead of their tokens and the worker receives plans whose input ids come from rank 0's samples
(`comm.broadcast_`, MPI here, NCCL between GPUs). Rank 0 serves the requests ([input ids, generation config]
each) together through an Engine and writes their tokens and both ranks' count of such steps.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/

from eager_graphs import install_on_every_runner
from helpers import run_together

from allspark_client.config import AsModelRuntimeConfigBuilder
from allspark_server.collective.comm import get_comm
from allspark_server.engine.step_loops import OverlappedLoop


def main():
    graph, weights, requests_json, out_json = sys.argv[1:5]
    install_on_every_runner(max_batch=4)
    comm = get_comm()
    counts = {}
    if comm.rank == 0:
        from allspark_server import Engine
        engine = Engine(comm)
        cfg = (AsModelRuntimeConfigBuilder().model_name("m").model_file_path(graph, weights).max_length(256)
               .max_batch(4).kv_cache_span_size(16).build())
        engine.install_model(cfg)
        engine.start_model("m")
        served = engine._models["m"]
        assert isinstance(served.loop, OverlappedLoop), ("overlapped scheduling is on by default in a pool of ranks "
                                                         "with decode graphs")
        tokens = [t for t, _ in run_together(engine, "m", json.loads(requests_json))]
        counts[0] = served.runner.graphs.device_steps
        engine.shutdown()
    else:
        from allspark_server.pool.worker import run_worker
        runners = {}
        import allspark_server.pool.worker as worker_mod
        install = worker_mod.install_runner

        def keep(cfg, c):
            runners[cfg.model_name] = install(cfg, c)
            return runners[cfg.model_name]
        worker_mod.install_runner = keep
        run_worker(comm)
        counts[1] = runners["m"].graphs.device_steps
    everything = comm.allgather_obj(counts)
    if comm.rank == 0:
        with open(out_json, "w") as f:
            json.dump({"tokens": tokens, "device_steps": [c.get(r) for r, c in enumerate(everything)]}, f)


if __name__ == "__main__":
    main()
