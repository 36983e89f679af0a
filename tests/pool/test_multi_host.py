"""A pool across hosts, for real on one machine: two network namespaces with their own hostnames, cores and
sshd (tests/netns_hosts.py), one `allspark-launch --host a,b` whose mpirun reaches them over ssh. The pool
must serve transformers' greedy output (as the 1-host pool does) with one rank on each host, each placed by
its own host's topology; and a host whose network goes away must end every stream with an error, leave the
client with PoolUnavailable and end the pool non-zero."""
from __future__ import annotations

import re
import subprocess
import time

import pytest
from helpers import LONG_RUN_MAX_LENGTH, collect, hf_greedy, random_prompt
from netns_hosts import NetnsHosts
from pool_helpers import MODEL, REDO_SPOILED, client_greedy, cmdline, greedy_cfg, install, wait_until
from test_pool_failures import FAULT_STREAMS, assert_streams_fail_within, start_streams

from allspark_client.client import PoolUnavailable

pytestmark = pytest.mark.skipif(NetnsHosts.unavailable() is not None,
                                reason=f"no network namespaces: {NetnsHosts.unavailable()}")


@pytest.fixture(scope="module")
def hosts():
    try:
        made = NetnsHosts(2)
    except subprocess.CalledProcessError as e:     # `ip` refused: this machine cannot make the namespaces
        pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    yield made
    made.close()


LAYOUT_WAIT_S = 30


def start_two_host_pool(new_pool, hosts, *extra_args):
    return new_pool(extra_args=extra_args, hosts=hosts.addresses, mpirun_args=tuple(hosts.mpirun_args()))


def test_two_host_pool_serves_transformers_greedy_output(new_pool, hosts, loader, llama):
    pool = start_two_host_pool(new_pool, hosts)
    # each rank reports where it runs: its own host (hostname), node and cores, read on that host. mpirun forwards
    # the ranks' output when it gets to it, so those lines may reach the log after the launcher's "ready"
    want = {"0": "allspark-host0", "1": "allspark-host1"}

    def layout() -> dict:
        return dict(re.findall(r"rank (\d) on (allspark-host\d): NUMA node", pool.log()))

    wait_until(lambda: layout() == want, LAYOUT_WAIT_S, step_s=0.1)
    assert layout() == want, pool.log()
    ranks = pool.ranks()
    assert sorted(hosts.host_of(p.pid) for p in ranks) == [0, 1]                # one rank in each namespace
    assert len({tuple(p.cpu_affinity()) for p in ranks}) == 2                  # on that host's own cores
    assert all("--place-on-host" in cmdline(p) for p in pool.ranks())

    client = pool.client()
    install(client, loader, max_length=256)
    for seed, n in ((61, 7), (62, 13), (63, 3)):
        prompt = random_prompt(n, seed=seed)
        assert client_greedy(client, prompt, 16) == hf_greedy(llama.model, prompt, 16), seed
    # concurrent streams: batched decode across the hosts
    prompts = [random_prompt(5 + i, seed=70 + i) for i in range(4)]
    queues = [client.start_request(MODEL, {"input_ids": p}, greedy_cfg(12))[2] for p in prompts]
    for p, q in zip(prompts, queues):
        tokens, _, _ = collect(q, timeout_s=60)
        assert tokens == hf_greedy(llama.model, p, 12)


@REDO_SPOILED
def test_host_network_loss_ends_streams_and_the_pool(new_pool, hosts, loader):
    """Host 1's link goes down under FAULT_STREAMS streams: rank 0 waits in an allreduce that never completes, the step
    watchdog (--step-timeout 3) ends every stream within 3 + 5 s, calls raise PoolUnavailable and the launcher
    exits non-zero. When the link comes back, the cut-off host's rank finds its peer gone and exits too."""
    pool = start_two_host_pool(new_pool, hosts, "--step-timeout", "3")
    client = pool.client()
    install(client, loader, max_length=LONG_RUN_MAX_LENGTH, max_batch=max(8, FAULT_STREAMS))
    queues = start_streams(client)
    cut_at = time.monotonic()
    hosts.link(1, up=False)
    try:
        slowest = assert_streams_fail_within(queues, cut_at, 3 + 5.0, needle="did not finish within", pool=pool)
        with pytest.raises(PoolUnavailable):
            client.get_as_engine_stat(MODEL)
        code = assert_pool_gone_but_the_cut_off_rank(pool, hosts)
    finally:
        hosts.link(1, up=True)
    # back on the network, the stranded rank (and its host's MPI daemon) notice the pool is gone and exit
    assert wait_until(lambda: not pool.rank_processes_left(), 90.0, 0.5), \
        [(p.pid, cmdline(p)) for p in pool.rank_processes_left()]
    print(f"host network lost: streams failed {slowest:.2f}s after the link went down; launcher exit {code}")


def assert_pool_gone_but_the_cut_off_rank(pool, hosts) -> int:
    """The launcher exits non-zero within 30 s and every rank on a reachable host is gone; the rank on host 1,
    which nobody can reach to stop, may still run until its network returns."""
    try:
        code = pool.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within 30 s of the host's network loss:\n{pool.log()}")
    assert code != 0, pool.log()
    left = [p for p in pool.rank_processes_left() if hosts.host_of(p.pid) != 1]
    assert not left, [(p.pid, cmdline(p)) for p in left]
    return code
