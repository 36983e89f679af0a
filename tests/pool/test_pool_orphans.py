"""Requests nobody will release (issue 38, part 8): a client that dies after its streams finished but before
release_request no longer pins the model for good (the pool releases them --orphan-grace seconds after the client's
connection is gone), a live client's finished requests are never released behind its back, and an operator can
force-release a model's requests, whoever holds them."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import collect, random_prompt
from pool_helpers import (
    MODEL,
    REDO_SPOILED,
    REPO,
    client_greedy,
    greedy_cfg,
    install,
    repo_env,
    start_running_streams,
    wait_until,
)

from allspark_client import AsException, GenerateRequestStatus
from allspark_client.types import AsStatus

GRACE_S = 2.0

DYING_CLIENT = textwrap.dedent("""
    import os, signal, sys
    from allspark_client import ClientEngine
    client = ClientEngine(sys.argv[1], start_timeout_s=60)
    for seed in range(4):
        status, handle, queue = client.start_request("llama", {"input_ids": [5 + seed, 6, 7]},
                                                     {"top_k": 1, "max_new_tokens": 3, "eos_token_id": []})
        assert status == 0, client.get_last_error()
        while queue.Get() is not None:        # read to the end: the request is finished, not released
            pass
    print("finished 4", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)      # dies before release_request
""")


def finished_unreleased(client, seed: int):
    status, handle, queue = client.start_request(MODEL, {"input_ids": random_prompt(5, seed=seed)}, greedy_cfg(3))
    assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    _, _, final = collect(queue, timeout_s=60)
    assert final == GenerateRequestStatus.GenerateFinished
    return handle


def unreleased(operator) -> int:
    """How many requests of the model the pool holds unreleased, from stop_model's refusal (0: it stopped)."""
    if operator.stop_model(MODEL) == AsStatus.ALLSPARK_SUCCESS:
        return 0
    found = re.search(r"has (\d+) unreleased request", operator.get_last_error())
    assert found, operator.get_last_error()
    return int(found.group(1))


def test_a_dead_clients_finished_requests_are_released_after_the_grace(new_pool, loader):
    pool = new_pool(extra_args=("--orphan-grace", str(GRACE_S)))
    operator, keeper = pool.client(), pool.client()
    install(operator, loader)
    kept = [finished_unreleased(keeper, seed) for seed in (1, 2)]     # their client lives: never released for it
    dying = subprocess.run([sys.executable, "-c", DYING_CLIENT, pool.address], capture_output=True, cwd=REPO,
                           env=repo_env(), timeout=120)
    assert dying.returncode == -9 and b"finished 4" in dying.stdout, dying.stderr.decode()[-3000:]
    assert 2 <= unreleased(operator) <= 6             # 6 until the grace has passed, then released one by one
    assert wait_until(lambda: unreleased(operator) == 2, 60.0, 0.2), operator.get_last_error()
    def logged() -> bool:           # the whole log (the polls above fill its tail), once mpirun has relayed it
        with open(pool.log_path, errors="replace") as f:
            return "its client has been gone for 2 s" in f.read()
    assert wait_until(logged, 30.0, 0.2)
    time.sleep(3 * GRACE_S)                            # well past the grace: the keeper's requests stay its own
    assert unreleased(operator) == 2
    for handle in kept:
        assert keeper.release_request(MODEL, handle) == AsStatus.ALLSPARK_SUCCESS, keeper.get_last_error()
    assert operator.stop_model(MODEL) == AsStatus.ALLSPARK_SUCCESS, operator.get_last_error()


@REDO_SPOILED
def test_an_operator_force_releases_a_models_requests(new_pool, loader):
    pool = new_pool()
    operator, holder = pool.client(), pool.client()
    install(operator, loader)
    finished = [finished_unreleased(holder, seed) for seed in (3, 4)]
    [(_, running, queue, _)] = start_running_streams(holder, [random_prompt(6, seed=5)])
    assert operator.stop_model(MODEL) == AsStatus.ALLSPARK_RUNTIME_ERROR
    assert "has 3 unreleased request(s)" in operator.get_last_error() and "force=True" in operator.get_last_error()
    assert operator.release_model(MODEL, force=True) == AsStatus.ALLSPARK_SUCCESS, operator.get_last_error()
    assert wait_until(lambda: queue.GenerateStatus().is_terminal, 30.0)          # the running one was stopped
    for handle in finished + [running]:        # the holder is told its handles are gone, with a status
        assert holder.release_request(MODEL, handle) != AsStatus.ALLSPARK_SUCCESS
    with pytest.raises(AsException):
        operator.get_model_info(MODEL)         # released
    install(operator, loader)                  # and the name is free again
    assert len(client_greedy(operator, random_prompt(5, seed=6), 3)) == 3
