"""2-rank tensor parallelism: logits equal the single process (fp32, <= 1e-4), greedy tokens equal
the in-process Engine and transformers — including a model with fewer KV heads than ranks, and models whose
head counts the ranks do not divide."""
from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from helpers import collect, greedy, hf_greedy, installed_on_pool, random_prompt, serialize

from allspark_client import AsException, AsStatus

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP_VARIANTS = ["llama_gqa_llama3", "qwen2_bias_tied", "llama_mqa"]


def mpirun_env():
    path = os.pathsep.join(filter(None, [os.path.dirname(TESTS), os.environ.get("PYTHONPATH")]))
    # shared memory only between the two local ranks, as the launcher's single-host pools (MPI_Init then skips the
    # ~1 s probe of the network interfaces)
    env = {"OMPI_MCA_btl": "self,vader", **os.environ}
    return dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=path)


def _forward_lines(out, lines: queue.Queue) -> None:
    for line in out:
        lines.put(line)
    lines.put("")                                        # the output ended


class _LogitsWorker:
    """tests/mpi/tp_logits.py --serve on 2 ranks, started at the first job and kept for the session's others."""
    proc = None
    lines: queue.Queue = queue.Queue()

    @classmethod
    def run(cls, job: list, timeout_s: float = 240) -> None:
        if cls.proc is None or cls.proc.poll() is not None:
            cmd = ["mpirun", "--bind-to", "none", "-n", "2", sys.executable,
                   os.path.join(TESTS, "mpi", "tp_logits.py"), "--serve"]
            cls.proc = subprocess.Popen(cmd, env=mpirun_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
            cls.lines = queue.Queue()
            threading.Thread(target=_forward_lines, args=(cls.proc.stdout, cls.lines), daemon=True).start()
            atexit.register(cls.close)
        printed = []
        cls.proc.stdin.write(json.dumps(job) + "\n")
        cls.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = cls.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                cls.close(kill=True)
                raise AssertionError(f"no answer from tp_logits.py in {timeout_s} s:\n" + "".join(printed[-40:]))
            if line.strip() == "DONE":
                return
            printed.append(line)
            if not line or line.startswith("ERROR "):       # "": the worker's output ended
                cls.close(kill=True)
                raise AssertionError("tp_logits.py failed:\n" + "".join(printed[-40:]))

    @classmethod
    def close(cls, kill: bool = False) -> None:
        proc, cls.proc = cls.proc, None
        if proc is None or proc.poll() is not None:
            return
        if not kill:
            try:   # an empty line ends the ranks' loop: mpirun does not pass its stdin's EOF on to rank 0
                proc.stdin.write("\n")
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=30)
                return
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait()


def tp_logits(loader, tokens: list[int], prompt_len: int, tmp_path) -> dict:
    """tests/mpi/tp_logits.py's comparison on 2 ranks over the loader's model files; its JSON result."""
    out = tmp_path / "result.json"
    _LogitsWorker.run([loader.graph_path, loader.weights_path, list(tokens), int(prompt_len), str(out)])
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_tp_logits_equal_single_process(tiny_models, tmp_path, variant):
    tm = tiny_models[variant]
    loader = serialize(tm.hf_dir, variant, str(tmp_path))
    prompt = random_prompt(64, seed=11)
    result = tp_logits(loader, prompt + hf_greedy(tm.model, prompt, 32), 64, tmp_path)
    print(f"{variant}: 2-rank vs 1-rank max |logit diff| = {result['max_abs_diff']:.2e}")
    assert result["world_size"] == 2 and result["shape"] == [96, 512]
    assert result["max_abs_diff"] <= 1e-4, result
    assert result["argmax_equal"]


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_pool_greedy_equals_engine_and_transformers(pool, served_llama, tiny_models, tmp_path, variant):
    client, _ = pool
    tm = tiny_models[variant]
    loader = serialize(tm.hf_dir, f"tp_{variant}", str(tmp_path))
    name = f"tp_{variant}"
    with installed_on_pool(client, loader, name, max_length=512):
        for seed, n in ((1, 5), (2, 40), (3, 130)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(client, name, prompt, 40) == hf_greedy(tm.model, prompt, 40)


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (9, 3), (6, 3)])
def test_heads_the_ranks_do_not_divide_split_unevenly(pool, tmp_path, heads, kv_heads):
    """SmolLM2-135M's shape (9 query, 3 KV heads) on 2 ranks: KV groups dealt out 1 + 2; greedy tokens equal
    transformers', and the 2-rank logits the single process's."""
    from allspark_server.loader.tiny_model import build_tiny_model
    client, _ = pool
    d, name = str(tmp_path / "hf"), f"uneven_{heads}_{kv_heads}"
    model = build_tiny_model(d, "llama_gqa_llama3", hidden_size=16 * heads, num_heads=heads, num_kv_heads=kv_heads,
                             tokenizer=False)
    loader = serialize(d, name, str(tmp_path / "out"))
    with installed_on_pool(client, loader, name, max_length=256):
        for seed, n in ((1, 5), (2, 40)):
            prompt = random_prompt(n, seed=seed)
            assert greedy(client, name, prompt, 24) == hf_greedy(model, prompt, 24)
    prompt = random_prompt(32, seed=5)
    result = tp_logits(loader, prompt + hf_greedy(model, prompt, 8), 32, tmp_path)
    assert result["max_abs_diff"] <= 1e-4 and result["argmax_equal"], result


def test_split_that_cannot_be_made_is_refused_at_install(pool, tmp_path):
    """3 query heads sharing 1 KV head: each rank would need a copy of the KV head and an equal share of the
    query heads, which 3 cannot give 2 ranks."""
    from allspark_server.loader.tiny_model import build_tiny_model
    client, _ = pool
    d = str(tmp_path / "hf")
    build_tiny_model(d, "llama_mha_tied", hidden_size=48, num_heads=3, num_kv_heads=1, tokenizer=False)
    loader = serialize(d, "three_heads", str(tmp_path / "out"))
    rt = loader.create_reference_runtime_config_builder("three_heads", "cpu", [0], max_batch=2).max_length(128).build()
    with pytest.raises(AsException) as e:
        client.install_model(rt)
    assert "num_attention_heads 3 is not divisible by 2 ranks" in str(e.value)
    assert "three_heads" not in client.get_model_info("llama")
    prompt = random_prompt(10, seed=4)                      # the pool still serves
    assert len(greedy(client, "llama", prompt, 5)) == 5


def test_64_concurrent_streams_match_engine(pool, served_llama):
    client, _ = pool
    engine, _ = served_llama
    prompts = [random_prompt(1 + (37 * i) % 200, seed=500 + i) for i in range(64)]
    lengths = [1 + (13 * i) % 40 for i in range(64)]
    expected = [greedy(engine, "llama", p, n) for p, n in zip(prompts, lengths)]
    got: dict[int, list[int]] = {}
    errors: list[str] = []

    def worker(indices):
        started = []
        for i in indices:   # open all of this thread's streams first, then read them
            status, handle, queue = client.start_request(
                "llama", {"input_ids": prompts[i]}, {"top_k": 1, "max_new_tokens": lengths[i], "eos_token_id": []})
            if status != AsStatus.ALLSPARK_SUCCESS:
                errors.append(client.get_last_error())
                continue
            started.append((i, handle, queue))
        for i, handle, queue in started:
            tokens, _, final = collect(queue)
            got[i] = tokens
            if final.name != "GenerateFinished":
                errors.append(f"{i}: {final.name} {queue.ErrorMessage()}")
            client.release_request("llama", handle)

    threads = [threading.Thread(target=worker, args=(list(range(t, 64, 8)),)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [got[i] for i in range(64)] == expected
