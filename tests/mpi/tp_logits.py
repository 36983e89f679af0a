"""Run under mpirun: teacher-forced logits of a 2-rank tensor-parallel runner vs a single-process one.

    mpirun -n 2 python tests/mpi/tp_logits.py GRAPH WEIGHTS TOKENS_JSON PROMPT_LEN OUT_JSON
    mpirun -n 2 python tests/mpi/tp_logits.py --serve      (jobs as JSON lines on rank 0's stdin)

Every rank runs the same steps (a one-chunk prefill with every row's logits, then one token per
step); rank 0 also runs a single-process runner on the same files and writes the max |diff|.
With --serve the ranks stay up and take one job per stdin line ([graph, weights, tokens, prompt_len,
out_json]; rank 0 answers "DONE" or "ERROR <text>" on stdout), so the tests that compare shards pay
for the interpreters, torch and the pool's start once per session instead of once each.
"""
import gc
import json
import sys

import torch

from allspark_client.config import AsModelRuntimeConfigBuilder
from allspark_server.collective.comm import LocalComm, get_comm
from allspark_server.core.messages import ScheduledChunk
from allspark_server.runner.model_runner import install_runner
from allspark_server.step.inputs import RequestMirror, build_forward_inputs


def logits_all_steps(runner, tokens, prompt_len):
    spans = list(range(-(-len(tokens) // runner.span_size)))
    runner.mirrors = {1: RequestMirror(list(tokens[:prompt_len]), spans, 0)}
    chunks = [ScheduledChunk(1, prompt_len, True)] + [ScheduledChunk(1, 1, True)] * (len(tokens) - prompt_len)
    out = []
    for i, chunk in enumerate(chunks):
        if i:
            runner.mirrors[1].token_ids.append(tokens[prompt_len + i - 1])
        inputs = build_forward_inputs([chunk], runner.mirrors, runner.span_size)
        inputs.sample_rows = torch.arange(chunk.num_tokens)
        out.append(runner.model(inputs, runner.kv))
        runner.mirrors[1].num_computed_tokens += chunk.num_tokens
    return None if out[0] is None else torch.cat(out)


def run_job(comm, graph, weights, tokens, prompt_len, out_json):
    cfg = (AsModelRuntimeConfigBuilder().model_name("m").model_file_path(graph, weights).max_length(256)
           .max_batch(1).kv_cache_span_size(16).build())
    tp = logits_all_steps(install_runner(cfg, comm), tokens, prompt_len)
    if comm.rank == 0:
        single = logits_all_steps(install_runner(cfg, LocalComm()), tokens, prompt_len)
        with open(out_json, "w") as f:
            json.dump({"world_size": comm.world_size, "shape": list(tp.shape),
                       "max_abs_diff": (tp - single).abs().max().item(),
                       "argmax_equal": bool(torch.equal(tp.argmax(-1), single.argmax(-1)))}, f)


def serve(comm):
    """Jobs from rank 0's stdin until an empty line (or EOF, which mpirun does not pass on). A job that fails is
    reported and ends the run (the ranks could be at different collectives); the test side starts a fresh one for
    the next job."""
    while True:
        line = sys.stdin.readline() if comm.rank == 0 else None
        job = comm.bcast(json.loads(line) if line and line.strip() else None)
        if job is None:
            return
        try:
            run_job(comm, *job)
        except Exception as e:
            if comm.rank == 0:
                print("ERROR " + repr(e).replace("\n", " "), flush=True)
            raise
        if comm.rank == 0:
            print("DONE", flush=True)
        gc.collect()


def main():
    comm = get_comm()
    if sys.argv[1:] == ["--serve"]:
        serve(comm)
        return
    graph, weights, tokens_json, prompt_len, out_json = sys.argv[1:6]
    run_job(comm, graph, weights, json.loads(tokens_json), int(prompt_len), out_json)


if __name__ == "__main__":
    main()
