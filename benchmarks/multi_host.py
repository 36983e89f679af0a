"""A 2-host pool against a 1-host pool on the same cores: batch-1 decode, interleaved round by round.

The two "hosts" are network namespaces on this machine (tests/netns_hosts.py: own hostname, own core, sshd),
reached by mpirun over ssh; MPI's allreduce then runs over TCP through a bridge instead of shared memory. The
1-host pool is `allspark-launch --ranks 2` on the same two cores (one each). Both pools serve the same
serialized model; the report gives each round's tokens/s and the median of the same-round ratios (2-host over
1-host), and checks that both pools produce the same greedy tokens. Needs root (network namespaces), iproute2
and openssh-server.

    python benchmarks/multi_host.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import common  # noqa: E402

common.spin_openmp()    # before torch loads, as run.py (the pools started from here inherit it)

import workloads as W  # noqa: E402
from netns_hosts import NetnsHosts  # noqa: E402


def start_two_host_pool(hosts: NetnsHosts, socket_path: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "allspark_client.launch.launcher", "--host", ",".join(hosts.addresses),
           "--socket", socket_path, "--", *hosts.mpirun_args()]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small model, 3 rounds")
    common.add_smoke_flag(p)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=0, help="decode rounds (default: 3 quick, 7 full)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/multi-host-<machine>.json (--quick: "
                   "under results/quick/)")
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("multi-host", quick=a.quick or a.smoke)
    why = NetnsHosts.unavailable()
    if why:
        raise SystemExit(f"multi_host benchmark: {why}")
    from allspark_client import ClientEngine
    from allspark_server import HuggingFaceModel
    spec = common.spec_of(a)
    rounds = a.rounds or spec["decode_repeats"]
    hf_dir = common.build_model(spec, a.dtype)
    loader = HuggingFaceModel(hf_dir, f"bench-{a.dtype}", user_set_data_type=a.dtype)
    loader.load_model().serialize_to_path(None, hf_dir, skip_if_exists=False).free_model()
    name, vocab, n = loader.model_name, spec["vocab"], spec["new_tokens"]
    cfg = common.runtime_cfg(loader, name, spec, 4)

    hosts = NetnsHosts(2)
    launcher = None
    try:
        socket_path = os.path.join(hosts.dir, "pool.sock")
        launcher = start_two_host_pool(hosts, socket_path, os.path.join(hosts.dir, "pool.log"))
        engines = {"pool_1_host": ClientEngine(ranks=2),
                   "pool_2_hosts": ClientEngine("unix:" + socket_path, start_timeout_s=120)}
        for engine in engines.values():
            engine.install_model(cfg)
            engine.start_model(name)
        ids = W.prompt(24, 7, vocab)
        greedy = {key: W.greedy_tokens(e, name, ids, 32) for key, e in engines.items()}
        for key, e in engines.items():
            W.decode_tps(e, name, vocab, n, seed=99)                     # warm-up
        by_round: dict[str, list[float]] = {key: [] for key in engines}
        for r in range(rounds):
            for key, e in engines.items():
                by_round[key].append(W.decode_tps(e, name, vocab, n, seed=r))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in by_round.items()), flush=True)
        ratio = statistics.median(b / a for a, b in zip(by_round["pool_1_host"], by_round["pool_2_hosts"]))
        with open(os.path.join(hosts.dir, "pool.log"), errors="replace") as f:
            layout = [line.split(" INFO ", 1)[-1].strip() for line in f if " on allspark-host" in line]
        report = {"machine": common.machine_name(), "python": platform.python_version(), "model": spec,
                  "dtype": a.dtype, "new_tokens": n, "rounds": rounds, "layout_2_hosts": layout,
                  "decode_b1_tps_by_round": by_round,
                  "decode_b1_tps": {k: statistics.median(v) for k, v in by_round.items()},
                  "two_hosts_over_one_host": ratio,
                  "same_greedy_tokens": greedy["pool_1_host"] == greedy["pool_2_hosts"]}
        for e in engines.values():
            e.close()
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.terminate()
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
        hosts.close()
    print(json.dumps({k: v for k, v in report.items() if k != "model"}, indent=1))
    print(f"2-host / 1-host batch-1 decode (median of same-round ratios): {ratio:.3f}")
    common.write_report(a.json, report)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"took {time.time() - t0:.0f} s")
