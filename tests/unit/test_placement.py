"""A rank placing itself on its host (allspark_server/placement.py), worked by hand for hosts that differ."""
from __future__ import annotations

import pytest

from allspark_client.launch.rank_placement import RankPlacement
from allspark_server.pool import placement as pl

TWO_NODES = {0: list(range(0, 8)), 1: list(range(8, 16))}


def test_local_rank_from_each_mpi_launcher():
    assert pl.local_rank_and_size({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == (1, 2)
    assert pl.local_rank_and_size({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}) == (0, 4)     # MPICH Hydra
    assert pl.local_rank_and_size({"PMIX_LOCAL_RANK": "3", "PMIX_LOCAL_SIZE": "4"}) == (3, 4)
    with pytest.raises(pl.PlacementError, match="start this rank with mpirun"):
        pl.local_rank_and_size({})


def test_one_rank_per_node_and_shares_of_a_node():
    # one rank per node (mpirun's ppr:1:numa on a 2-node host)
    assert pl.place_on_host(0, 2, TWO_NODES) == RankPlacement(0, tuple(range(0, 8)))
    assert pl.place_on_host(1, 2, TWO_NODES) == RankPlacement(1, tuple(range(8, 16)))
    # fewer ranks than nodes: the first nodes, whole
    assert pl.place_on_host(0, 1, TWO_NODES) == RankPlacement(0, tuple(range(0, 8)))
    # four ranks on two nodes: each node's cores split in halves
    assert [pl.place_on_host(r, 4, TWO_NODES) for r in range(4)] == [
        RankPlacement(0, (0, 1, 2, 3)), RankPlacement(0, (4, 5, 6, 7)),
        RankPlacement(1, (8, 9, 10, 11)), RankPlacement(1, (12, 13, 14, 15))]
    # a one-node host with cores 4-5 only (its own affinity): two ranks, one core each
    assert [pl.place_on_host(r, 2, {0: [4, 5]}) for r in range(2)] == [RankPlacement(0, (4,)), RankPlacement(0, (5,))]
    with pytest.raises(pl.PlacementError, match="do not divide over its 2 NUMA node"):
        pl.place_on_host(0, 3, TWO_NODES)
    with pytest.raises(pl.PlacementError, match="cannot host 4 ranks"):
        pl.place_on_host(0, 4, {0: [0, 1]})


def test_numactl_command_keeps_memory_on_the_node():
    argv = ["python", "-m", "allspark_server", "--cpus", "8-15"]
    whole = pl.numactl_argv(RankPlacement(1, tuple(range(8, 16))), True, "/usr/bin/numactl", argv)
    assert whole == ["/usr/bin/numactl", "--cpunodebind", "1", "--membind", "1"] + argv
    share = pl.numactl_argv(RankPlacement(1, (12, 13, 14, 15)), False, "/usr/bin/numactl", argv)
    assert share[:5] == ["/usr/bin/numactl", "--physcpubind", "12-15", "--membind", "1"]


def test_self_place_on_a_one_node_host_returns_the_cpus(monkeypatch):
    """No re-exec on a one-node host (numactl would change nothing): the rank pins itself with --cpus."""
    monkeypatch.setattr(pl, "read_topology", lambda: {0: [2, 3]})
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert pl.self_place(["--place-on-host"], env) == "3"
    assert pl.self_place(["--place-on-host"], dict(env, **{pl.PLACED_ENV: "1"})) is None   # already placed


def test_self_place_reexecs_under_numactl_on_a_numa_host(monkeypatch):
    monkeypatch.setattr(pl, "read_topology", lambda: TWO_NODES)
    monkeypatch.setattr(pl.shutil, "which", lambda name: "/usr/bin/numactl" if name == "numactl" else None)
    monkeypatch.delenv(pl.PLACED_ENV, raising=False)
    execs = []

    def fake_execv(path, argv):
        execs.append(argv)
        raise SystemExit(0)
    monkeypatch.setattr(pl.os, "execv", fake_execv)
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(SystemExit):
        pl.self_place(["--place-on-host", "--socket", "/s"], env)
    argv = execs[0]
    assert argv[:5] == ["/usr/bin/numactl", "--cpunodebind", "1", "--membind", "1"]
    assert argv[6:] == ["-m", "allspark_server", "--socket", "/s", "--cpus", "8-15"]
    assert pl.os.environ[pl.PLACED_ENV] == "1"


def test_describe_placement_names_host_node_and_cores(monkeypatch):
    monkeypatch.setattr(pl, "read_topology", lambda: TWO_NODES)
    monkeypatch.setattr(pl.os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})
    monkeypatch.setattr(pl.socket, "gethostname", lambda: "node-b")
    assert pl.describe_placement(3, 4) == "rank 3 on node-b: NUMA node 1, cpus 8-11, 4 threads"
