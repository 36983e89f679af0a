"""Overlapped scheduling (engine/step_loops.py, OverlappedLoop), on the CPU: a decode step launched before the host has
read the previous step's tokens, its input ids taken from that step's sampled ids on the device.

On a GPU this runs from the CUDA graphs; here the runner gets an eager stand-in for them (same `fits_decode`
rule, same `run_decode(chunks, mirrors, device_ids)` contract) and the model's overlap is switched on, so the
scheduler's continuation plans, the mirrors that learn their tokens one plan late, the pending samples and the
one wasted step after a stop all run in CI. Outputs must equal transformers' greedy tokens, and for the other
sampling settings the same engine's without overlap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from eager_graphs import EagerDecodeGraphs
from helpers import assert_same_tokens, collect, hf_ref, random_prompt, run_together, serialize, start_engine
from test_tensor_parallel import mpirun_env

from allspark_server.engine.step_loops import OverlappedLoop

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NAME = "llama"


@pytest.fixture(scope="module")
def engines(llama, tmp_path_factory):
    """(overlapped engine, its eager graphs, the same model without overlap)."""
    loader = serialize(llama.hf_dir, NAME, str(tmp_path_factory.mktemp("overlap")))
    overlapped, plain = start_engine(loader, NAME, max_batch=4), start_engine(loader, NAME, max_batch=4)
    served = overlapped._models[NAME]
    graphs = EagerDecodeGraphs(served.runner, 4)
    served.runner.graphs, served.loop = graphs, OverlappedLoop()
    yield overlapped, graphs, plain
    overlapped.shutdown()
    plain.shutdown()


SAMPLING_REQUESTS = [(random_prompt(6 + i, 70 + i), g) for i, g in enumerate([
    {"top_k": 1, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "max_new_tokens": 16,
     "eos_token_id": []},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 7, "max_new_tokens": 16, "eos_token_id": []},
    {"top_k": 1, "logprobs": True, "top_logprobs": 3, "max_new_tokens": 12, "eos_token_id": []}])]


def assert_same_outputs(ours, theirs) -> None:
    """The same tokens, logprobs and top logprobs per token (a read may join elements: compared flat)."""
    assert any(x for _, e in ours for el in e for x in el.token_logprobs_list)
    for (t1, e1), (t2, e2) in zip(ours, theirs, strict=True):
        assert t1 == t2
        for field in ("token_logprobs_list", "log_probs_list"):
            assert [x for el in e1 for x in getattr(el, field)] == [x for el in e2 for x in getattr(el, field)]


def test_greedy_batch_equals_transformers_with_steps_fed_from_the_device(engines, llama):
    engine, graphs, _ = engines
    before = graphs.device_steps
    lengths = [24, 9, 17, 30]     # different lengths: requests leave the batch at different steps
    prompts = [random_prompt(5 + 3 * i, 40 + i) for i in range(4)]
    out = run_together(engine, NAME, [(p, {"top_k": 1, "max_new_tokens": n, "eos_token_id": []})
                                for p, n in zip(prompts, lengths)])
    for (tokens, _), p, n in zip(out, prompts, lengths):
        assert tokens == hf_ref(llama.model, p, n)
    assert graphs.device_steps - before >= 10   # most decode steps ran ahead of their tokens


def test_stop_token_ends_the_request_and_the_step_computed_ahead_is_dropped(engines, llama):
    engine, graphs, _ = engines
    prompt = random_prompt(7, 11)
    ref = hf_ref(llama.model, prompt, 20)
    k = next(i for i in range(6, 20) if ref[i] not in ref[:i])   # a token first produced at step k
    other = random_prompt(9, 12)
    before = graphs.device_steps
    out = run_together(engine, NAME, [(prompt, {"top_k": 1, "max_new_tokens": 20, "eos_token_id": [ref[k]]}),
                                (other, {"top_k": 1, "max_new_tokens": 20, "eos_token_id": []})])
    assert out[0][0] == ref[:k + 1]      # stopped at its EOS, nothing after it
    assert out[1][0] == hf_ref(llama.model, other, 20)
    assert graphs.device_steps > before
    stat = engine.get_as_engine_stat(NAME)
    assert stat.used_span == 0 and stat.free_token == stat.total_token   # every span given back


def test_sampling_settings_equal_the_engine_without_overlap(engines):
    """Penalties, seeded draws and logprobs are applied after the previous step's update: the same tokens and
    logprobs as without overlap."""
    engine, graphs, plain = engines
    before = graphs.device_steps
    ours, theirs = run_together(engine, NAME, SAMPLING_REQUESTS), run_together(plain, NAME, SAMPLING_REQUESTS)
    assert graphs.device_steps > before
    assert_same_outputs(ours, theirs)


def test_arrivals_and_stops_while_steps_run_ahead(engines, llama):
    """A request stopped mid-run ends cleanly; one that arrives while others decode joins them; every greedy
    output still equals transformers'."""
    engine, _, _ = engines
    long_prompt, late_prompt = random_prompt(6, 90), random_prompt(8, 91)
    status, h_long, q_long = engine.start_request(NAME, {"input_ids": long_prompt},
                                                  {"top_k": 1, "max_new_tokens": 400, "eos_token_id": []})
    assert status == 0
    first = q_long.Get()                 # decoding now
    assert first is not None
    late = threading.Thread(target=lambda: results.append(run_together(
        engine, NAME, [(late_prompt, {"top_k": 1, "max_new_tokens": 25, "eos_token_id": []})])))
    results: list = []
    late.start()
    late.join(120)
    engine.stop_request(NAME, h_long)
    tokens, _, final = collect(q_long)
    tokens = first.ids_from_generate + tokens
    engine.release_request(NAME, h_long)
    assert final.name == "GenerateFinished"
    assert_same_tokens(tokens, hf_ref(llama.model, long_prompt, len(tokens)))
    assert results[0][0][0] == hf_ref(llama.model, late_prompt, 25)
    assert engine.get_as_engine_stat(NAME).running_request == 0


def test_min_length_counts_the_token_of_the_step_before(engines, llama):
    """EOS stays masked up to min_length, counted with the previous step's token (sampled after its update): the
    request stops exactly at the first step where its EOS may and does win."""
    engine, graphs, _ = engines
    prompt = random_prompt(6, 33)
    ref = hf_ref(llama.model, prompt, 24)
    k = next(i for i in range(8, 23) if ref[i + 1] not in ref[:i + 1])   # ref[k + 1] first appears there
    gen = {"top_k": 1, "max_new_tokens": 24, "eos_token_id": [ref[k + 1]], "min_length": len(prompt) + k + 1}
    before = graphs.device_steps
    (tokens, _), = run_together(engine, NAME, [(prompt, gen)])
    assert tokens == ref[:k + 2]
    assert graphs.device_steps > before



def test_a_pool_runs_ahead_with_the_ids_sent_to_the_other_rank(llama, tmp_path):
    """A 2-rank pool (mpirun, CPU; overlapped scheduling is a pool's default too): rank 0 launches decode steps
    ahead of their tokens and the worker runs the same steps from ids that rank 0 sends it (`comm.broadcast_`), its
    mirrors learning the tokens one plan late; greedy output equals transformers', a stop token ends its request
    exactly."""
    loader = serialize(llama.hf_dir, "m", str(tmp_path / "model"))
    prompts = [random_prompt(5 + 4 * i, 120 + i) for i in range(3)]
    ref = hf_ref(llama.model, prompts[2], 20)
    k = next(i for i in range(6, 20) if ref[i] not in ref[:i])
    requests = [(prompts[0], {"top_k": 1, "max_new_tokens": 24, "eos_token_id": []}),
                (prompts[1], {"top_k": 1, "max_new_tokens": 11, "eos_token_id": []}),
                (prompts[2], {"top_k": 1, "max_new_tokens": 20, "eos_token_id": [ref[k]]})]
    out = tmp_path / "out.json"
    cmd = ["mpirun", "--bind-to", "none", "-n", "2", sys.executable, os.path.join(TESTS, "mpi", "overlap_pool.py"),
           loader.graph_path, loader.weights_path, json.dumps(requests), str(out)]
    env = {k: v for k, v in mpirun_env().items() if k != "ALLSPARK_OVERLAP"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["tokens"][0] == hf_ref(llama.model, prompts[0], 24)
    assert result["tokens"][1] == hf_ref(llama.model, prompts[1], 11)
    assert result["tokens"][2] == ref[:k + 1]
    rank0, rank1 = result["device_steps"]
    assert rank0 >= 10 and rank1 == rank0
