"""allspark-launch --gpus without a GPU: the NUMA lookup (a fake nvidia-smi and a fake sysfs tree), the
per-rank env and numactl of the mpirun command, the errors, the pool config key, ClientEngine(gpus=...),
a real mpirun giving each rank its own CUDA_VISIBLE_DEVICES, and the rank's device under the launcher
(compute/device_choice.py)."""
from __future__ import annotations

import glob
import os
import shlex
import shutil
import tempfile

import pytest

from allspark_client import settings
from allspark_client.config import ConfigError
from allspark_client.launch.gpu_topology import gpu_numa_nodes, parse_gpu_list, sysfs_pci_address, visible_gpus
from allspark_client.launch.launcher import main as launch_main
from allspark_client.launch.pool_config import load_pool_config

# (nvidia-smi index, its pci.bus_id, numa_node in sysfs: None = no such file)
FAKE_GPUS = [(0, "00000000:3B:00.0", "0"), (1, "00000000:86:00.0", "1"), (2, "00000001:AF:00.0", "-1"),
             (3, "00000000:D8:00.0", None)]
ENV = ["env", "CUDA_VISIBLE_DEVICES={0}", "ALLSPARK_RANK_GPU={0}", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]


def fake_machine(tmp_path, gpus=FAKE_GPUS, smi_exit=0, smi_stderr=""):
    """A sysfs root and an nvidia-smi script in tmp_path answering like the real ones."""
    sysfs = tmp_path / "sys"
    for _, bus_id, node in gpus:
        dev = sysfs / "bus" / "pci" / "devices" / sysfs_pci_address(bus_id)
        dev.mkdir(parents=True)
        if node is not None:
            (dev / "numa_node").write_text(node + "\n")
    smi = tmp_path / "nvidia-smi"
    lines = "".join(f"echo '{i}, {bus_id}'\n" for i, bus_id, _ in gpus)
    smi.write_text(f"#!/bin/sh\n"
                   f"[ \"$1 $2\" = '--query-gpu=index,pci.bus_id --format=csv,noheader' ] || exit 2\n"
                   f"{lines}echo {shlex.quote(smi_stderr)} >&2\nexit {smi_exit}\n")
    smi.chmod(0o755)
    return str(sysfs), str(smi)


def gpu_dry_run(capsys, tmp_path, *argv, gpus=FAKE_GPUS):
    """The launcher's --dry-run on the fake machine: (per-rank argv lists, stderr)."""
    sysfs, smi = fake_machine(tmp_path, gpus)
    assert launch_main(list(argv) + ["--nvidia-smi", smi, "--sysfs-root", sysfs, "--dry-run",
                                     "--python", "python3", "--socket", "/tmp/x.sock"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("# topology")
    cmd = shlex.split(lines[1])
    parts, cur = [], []
    for tok in cmd[cmd.index("-n"):]:
        if tok == ":":
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    return parts + [cur], captured.err


@pytest.fixture
def fake_host(monkeypatch):
    """numactl 'installed', no CUDA_VISIBLE_DEVICES, and fixed (no) ISA flags."""
    import allspark_client.launch.launcher as launcher
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/numactl" if name == "numactl" else real_which(name))
    monkeypatch.setattr(launcher, "isa_flags", lambda: [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_numa_node_of_each_gpu_from_nvidia_smi_and_sysfs(tmp_path):
    sysfs, smi = fake_machine(tmp_path)
    assert sysfs_pci_address("00000001:AF:00.0") == "0001:af:00.0"
    assert gpu_numa_nodes(None, sysfs, smi) == {0: 0, 1: 1, 2: -1, 3: -1}        # every GPU; -1: no NUMA info
    assert list(gpu_numa_nodes([1, 0], sysfs, smi).items()) == [(1, 1), (0, 0)]  # the order asked for
    assert parse_gpu_list("all") is None and parse_gpu_list("2, 0") == [2, 0]
    for bad in ("0,x", "0,0", "-1"):
        with pytest.raises(SystemExit, match="--gpus takes"):
            parse_gpu_list(bad)


def test_numa_lookup_errors_name_the_problem(tmp_path):
    sysfs, smi = fake_machine(tmp_path)
    with pytest.raises(SystemExit, match=r"GPU\(s\) \[7\] not found: .* lists 0, 1, 2, 3"):
        gpu_numa_nodes([0, 7], sysfs, smi)
    with pytest.raises(SystemExit, match="'no-such-nvidia-smi' not found .* --nvidia-smi"):
        gpu_numa_nodes(None, sysfs, "no-such-nvidia-smi")
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(SystemExit, match="lists no GPU"):
        gpu_numa_nodes(None, *fake_machine(empty, gpus=[]))
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(SystemExit, match="exited 9: .*couldn't communicate with the NVIDIA driver"):
        gpu_numa_nodes(None, *fake_machine(broken, gpus=[], smi_exit=9,
                                           smi_stderr="NVIDIA-SMI has failed because it couldn't communicate "
                                                      "with the NVIDIA driver"))


def test_gpus_0_1_give_each_rank_its_gpu_and_its_numa_node(capsys, tmp_path, fake_host):
    ranks, _ = gpu_dry_run(capsys, tmp_path, "--gpus", "0,1", "--topology", "0:0-7;1:8-15")
    assert len(ranks) == 2                          # --ranks defaults to the number of GPUs
    for gpu, (node, cpus, rank) in enumerate(zip((0, 1), ("0-7", "8-15"), ranks)):
        assert rank[:11] == ["-n", "1"] + [t.format(gpu) for t in ENV] + [
            "/usr/bin/numactl", "--cpunodebind", str(node), "--preferred", str(node)]
        assert rank[11:14] == ["python3", "-m", "allspark_server"]
        assert rank[rank.index("--cpus") + 1] == cpus and rank[rank.index("--threads") + 1] == "8"
    ranks, _ = gpu_dry_run(capsys, tmp_path / "b", "--gpus", "1,0", "--topology", "0:0-7;1:8-15")
    assert [r[3] for r in ranks] == ["CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES=0"]   # rank r: r-th GPU listed
    assert [r[r.index("--cpunodebind") + 1] for r in ranks] == ["1", "0"]


def test_gpus_sharing_a_node_split_its_cores_and_unknown_nodes_are_not_pinned(capsys, tmp_path, fake_host):
    two_per_node = [(0, "00000000:1A:00.0", "0"), (1, "00000000:1B:00.0", "0"), (2, "00000000:9A:00.0", "1"),
                    (3, "00000000:9B:00.0", "1")]
    ranks, _ = gpu_dry_run(capsys, tmp_path, "--gpus", "--topology", "0:0-7;1:8-15", gpus=two_per_node)  # = all
    assert [r[r.index("--cpunodebind") + 1] for r in ranks] == ["0", "0", "1", "1"]
    assert [r[r.index("--cpus") + 1] for r in ranks] == ["0-3", "4-7", "8-11", "12-15"]
    ranks, err = gpu_dry_run(capsys, tmp_path / "b", "--gpus", "all", "--topology", "0:0-3;1:4-7")
    assert [r[3] for r in ranks] == [f"CUDA_VISIBLE_DEVICES={g}" for g in range(4)]
    assert ["numactl" in " ".join(r) for r in ranks] == [True, True, False, False]   # GPUs 2, 3: numa_node -1 / none
    assert "rank 2 (GPU 2) is not NUMA-pinned: sysfs gives its PCI device no NUMA node" in err
    assert "rank 3 (GPU 3) is not NUMA-pinned" in err
    ranks, err = gpu_dry_run(capsys, tmp_path / "c", "--gpus", "0,1", "--topology", "0:0-3")   # one-node machine
    assert all("numactl" not in " ".join(r) for r in ranks) and "this machine has one NUMA node" in err
    assert [r[r.index("--cpus") + 1] for r in ranks] == ["0-1", "2-3"]


def test_ranks_must_match_the_gpus_and_numa_nodes_do_not_combine(capsys, tmp_path, fake_host):
    with pytest.raises(SystemExit) as e:
        gpu_dry_run(capsys, tmp_path, "--gpus", "0,1", "--ranks", "3", "--topology", "0:0-3;1:4-7")
    assert str(e.value.code) == ("allspark-launch: --ranks 3 does not match --gpus 0,1 (2 GPU(s)): "
                                 "a GPU pool runs one rank per GPU")
    ranks, _ = gpu_dry_run(capsys, tmp_path / "b", "--gpus", "0,1", "--ranks", "2", "--topology", "0:0-3;1:4-7")
    assert len(ranks) == 2
    with pytest.raises(SystemExit, match="--gpus 0 and --numa-nodes 1 cannot be combined"):
        gpu_dry_run(capsys, tmp_path / "c", "--gpus", "0", "--numa-nodes", "1")


def test_gpus_all_honours_cuda_visible_devices(capsys, tmp_path, fake_host, monkeypatch):
    assert visible_gpus("all", {"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    assert visible_gpus("0", {"CUDA_VISIBLE_DEVICES": "3,1"}) == [0]          # an explicit list wins
    assert visible_gpus("all", {}) is None
    for value in ("", "GPU-5f2c0e7e"):
        with pytest.raises(SystemExit, match="names no GPU index"):
            visible_gpus("all", {"CUDA_VISIBLE_DEVICES": value})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    ranks, _ = gpu_dry_run(capsys, tmp_path, "--gpus", "--topology", "0:0-3;1:4-7")
    assert len(ranks) == 1 and ranks[0][3] == "CUDA_VISIBLE_DEVICES=1" and ranks[0][4] == "ALLSPARK_RANK_GPU=1"


def test_pool_config_gpus_key(capsys, tmp_path, fake_host):
    good = tmp_path / "pool.toml"
    good.write_text('[pool]\ngpus = [1, 0]\nsocket = "/tmp/p.sock"\n')
    assert load_pool_config(str(good)).gpus == [1, 0]
    ranks, _ = gpu_dry_run(capsys, tmp_path / "m", "--pool-config", str(good), "--topology", "0:0-3;1:4-7")
    assert [r[3] for r in ranks] == ["CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES=0"]
    (tmp_path / "all.toml").write_text('[pool]\ngpus = "all"\n')
    ranks, _ = gpu_dry_run(capsys, tmp_path / "a", "--pool-config", str(tmp_path / "all.toml"), "--topology", "0:0-3")
    assert len(ranks) == 4
    ranks, _ = gpu_dry_run(capsys, tmp_path / "c", "--pool-config", str(good), "--gpus", "2", "--topology", "0:0-3")
    assert len(ranks) == 1 and ranks[0][3] == "CUDA_VISIBLE_DEVICES=2"       # the flag beats the file
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shipped = open(os.path.join(root, "launch", "pool.example.toml")).read()
    assert "\n# gpus = [0, 1]\n" in shipped                                  # the example, uncommented, is valid
    (tmp_path / "shipped.toml").write_text(shipped.replace("\n# gpus = [0, 1]\n", "\ngpus = [0, 1]\n"))
    assert load_pool_config(str(tmp_path / "shipped.toml")).gpus == [0, 1]
    for value in ("[]", "[0, 0]", "[-1]", "[true]", "'0,1'", "1", "[[0]]"):
        bad = tmp_path / "bad.toml"
        bad.write_text(f"[pool]\ngpus = {value}\n")
        with pytest.raises(ConfigError, match=r"\[pool\] gpus must be distinct GPU indices"):
            load_pool_config(str(bad))


def test_client_engine_passes_gpus_to_the_launcher(tmp_path, monkeypatch):
    """ClientEngine(gpus=...) spawns allspark-launch --gpus; a dry run ends the 'pool' at once, and the error
    carries the command the pool would have run."""
    from allspark_client import ClientEngine
    from allspark_client.client import PoolUnavailable
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sysfs, smi = fake_machine(tmp_path)
    extra = ("--nvidia-smi", smi, "--sysfs-root", sysfs, "--topology", "0:0-3;1:4-7", "--no-numactl", "--dry-run")
    pool_dirs = os.path.join(tempfile.gettempdir(), "allspark-pool-*")
    before = set(glob.glob(pool_dirs))
    for gpus, want in (([1, 0], ["1", "0"]), ("all", ["0", "1", "2", "3"])):
        with pytest.raises(PoolUnavailable) as e:
            ClientEngine(gpus=gpus, launcher_args=extra, start_timeout_s=60)
        command = [line for line in str(e.value).splitlines() if " -m allspark_server " in line][0]
        assert [t.split("=")[1] for t in shlex.split(command) if t.startswith("ALLSPARK_RANK_GPU=")] == want
    with pytest.raises(PoolUnavailable, match="--ranks 3 does not match --gpus 0,1"):
        ClientEngine(ranks=3, gpus=[0, 1], launcher_args=extra, start_timeout_s=60)
    # the spawned pools' directories (socket, log) are gone with them
    assert set(glob.glob(pool_dirs)) == before


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpirun_gives_each_rank_its_own_gpu_environment(tmp_path, monkeypatch):
    """The real mpirun, with a stand-in for the rank's python that records what each rank sees."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sysfs, smi = fake_machine(tmp_path)
    out = tmp_path / "seen"
    out.mkdir()
    rank = tmp_path / "fake-python"
    rank.write_text(f"#!/bin/sh\nr=${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}\n"
                    f"echo \"$CUDA_VISIBLE_DEVICES $ALLSPARK_RANK_GPU $CUDA_DEVICE_ORDER $*\" > {out}/rank$r\n")
    rank.chmod(0o755)
    assert launch_main(["--gpus", "1,0", "--nvidia-smi", smi, "--sysfs-root", sysfs, "--no-numactl",
                        "--python", str(rank), "--socket", str(tmp_path / "p.sock")]) == 0
    seen = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(seen) == ["rank0", "rank1"]
    assert seen["rank0"][:5] == ["1", "1", "PCI_BUS_ID", "-m", "allspark_server"]
    assert seen["rank1"][:5] == ["0", "0", "PCI_BUS_ID", "-m", "allspark_server"]


def test_rank_device_under_the_launcher_is_cuda_0(monkeypatch):
    import torch

    from allspark_server.compute.device_choice import rank_device_kind

    def rank_device(compute_unit, rank):
        return rank_device_kind(compute_unit, rank).device
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)          # the launcher's GPU only
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with settings.override(RANK_GPU=1):
        assert rank_device("CUDA:0,1", 1) == torch.device("cuda", 0) and chosen == [0]
        with pytest.raises(ValueError) as e:                           # rank 1 was given GPU 1, the unit says 3
            rank_device("CUDA:0,3", 1)
        assert "gives rank 1 GPU 3, but allspark-launch gave this rank GPU 1" in str(e.value)
        with pytest.raises(ValueError, match="names 2 GPU"):
            rank_device("CUDA:0,1", 2)
        assert rank_device("CPU:0", 1) == torch.device("cpu")
    with settings.override(RANK_GPU=None):                             # no launcher GPU: the unit's id, as before
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        chosen.clear()
        assert rank_device("CUDA:0,1", 1) == torch.device("cuda", 1) and chosen == [1]
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="GPU 1 does not exist here"):
            rank_device("CUDA:0,1", 1)


def _cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() == 0 or shutil.which("nvidia-smi") is None, reason="needs a GPU and nvidia-smi")
def test_launcher_gpus_pool_on_real_gpus_equals_transformers(llama, tmp_path, monkeypatch):
    """The real nvidia-smi and sysfs, then ClientEngine(gpus=...): each rank sees only its GPU (cuda:0) and the
    pool's greedy tokens equal transformers' (2 ranks and NCCL between isolated GPUs when there are 2)."""
    import json

    import torch
    from helpers import greedy, hf_greedy, random_prompt, serialize

    from allspark_client import ClientEngine
    from allspark_client.types import TargetDevice
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nodes = gpu_numa_nodes()
    assert sorted(nodes) == list(range(len(nodes))) and all(n >= -1 for n in nodes.values())
    gpus = [0, 1] if len(nodes) >= 2 else [0]
    loader = serialize(llama.hf_dir, "g", str(tmp_path))
    client = ClientEngine(gpus=gpus)
    try:
        cfg = (loader.create_reference_runtime_config_builder("g", TargetDevice.CUDA, gpus, max_batch=4)
               .max_length(256).kv_cache_span_size(16).build())
        client.install_model(cfg)
        client.start_model("g")
        info = json.loads(client.get_model_info("g"))
        assert info["world_size"] == len(gpus) and info["device"] == "cuda:0"
        for n in (6, 23):
            prompt = random_prompt(n, seed=40 + n)
            assert greedy(client, "g", torch.tensor([prompt]), 16) == hf_greedy(llama.model, prompt, 16)
    finally:
        client.close()
