"""The KV budget on a 2-rank pool whose ranks share one machine (issue 38, part 8): an explicit budget that the
machine's two ranks together cannot hold is refused naming both, one that fits alone but not beside a model already
installed is refused naming what that model holds (and fits once it is released), and automatic budgets with
max_batch=10**6 stop adding up beyond the machine's RAM: installs are refused with the numbers instead. The pools
run with ALLSPARK_KV_PREFAULT=0: the caches are only reserved here, never written, so none of this takes the RAM it
names (written, the three automatic budgets would fill most of the machine's memory)."""
from __future__ import annotations

import json

import psutil
import pytest
from pool_helpers import MODEL

from allspark_client import AsException
from allspark_client.types import AsStatus

GiB = float(1 << 30)


def config(loader, name: str, kv_bytes: int = 0, max_batch: int = 8):
    b = loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=max_batch)
    b.max_length(1024).kv_cache_span_size(16)
    if kv_bytes:
        b.kv_cache_memory(kv_bytes)
    return b.build()


def kv_bytes_per_rank(client, name: str) -> int:
    """From the model's shape and its span count (a float32 cache; the 2 ranks split the KV heads), not from the
    pool's own count of bytes."""
    info = json.loads(client.get_model_info(name))
    args, ranks = info["args"], info["world_size"]
    assert info["dtype"] == "float32" and info["kv_cache_mode"] == "default", info
    per_token = 2 * args["num_layers"] * (args["num_kv_heads"] // ranks) * args["head_dim"] * 4
    return info["kv_spans"] * info["span_size"] * per_token


def refusal(client, cfg) -> str:
    with pytest.raises(AsException) as e:
        client.install_model(cfg)
    assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR
    return e.value.message


@pytest.fixture
def lazy_pool(new_pool, monkeypatch):
    """A 2-rank pool whose KV caches are not written at install (the ranks inherit the launcher's environment)."""
    monkeypatch.setenv("ALLSPARK_KV_PREFAULT", "0")
    return new_pool()


def test_explicit_budgets_count_the_machines_ranks_and_installed_models(lazy_pool, loader):
    client = lazy_pool.client()
    available = psutil.virtual_memory().available
    message = refusal(client, config(loader, "both", int(0.6 * available)))      # 2 x 60% of MemAvailable
    assert "per rank x 2 rank(s) on this machine" in message and "does not fit" in message, message
    quarter = int(0.25 * available)
    assert client.install_model(config(loader, MODEL, quarter)) == AsStatus.ALLSPARK_SUCCESS
    assert json.loads(client.get_model_info(MODEL))["kv_cache_bytes"] == kv_bytes_per_rank(client, MODEL)
    message = refusal(client, config(loader, "second", quarter))                 # 2 x 25% more: over 90%
    held = float(message.split("the models already installed hold ")[1].split(" GiB")[0])
    assert abs(held - 2 * quarter / GiB) < 0.02, message                        # both ranks' share of the first
    assert client.release_model(MODEL) == AsStatus.ALLSPARK_SUCCESS
    assert client.install_model(config(loader, "second", quarter)) == AsStatus.ALLSPARK_SUCCESS   # room again


def test_automatic_budgets_never_add_up_beyond_the_machine(lazy_pool, loader):
    """The issue's three models with max_batch=10**6 on two ranks: what they reserve on the machine stays within its
    RAM (each used to take 40% of it per rank), and a model asking for more than is left is refused with the
    numbers."""
    client = lazy_pool.client()
    available = psutil.virtual_memory().available
    installed = []
    for i in range(3):
        assert client.install_model(config(loader, f"m{i}", max_batch=10**6)) == AsStatus.ALLSPARK_SUCCESS
        installed.append(kv_bytes_per_rank(client, f"m{i}"))
    # the ranks size against MemAvailable when each install runs, which other processes on a shared machine move
    # between these two readings
    available = max(available, psutil.virtual_memory().available)
    assert 2 * sum(installed) <= 0.95 * available, [b / GiB for b in installed]
    message = refusal(client, config(loader, "more", int(0.1 * available)))
    held = float(message.split("the models already installed hold ")[1].split(" GiB")[0])
    assert abs(held - 2 * sum(installed) / GiB) < 0.02 and "does not fit" in message, message
    print(f"three models reserve {[round(b / GiB, 2) for b in installed]} GiB per rank, {2 * sum(installed) / GiB:.1f} "
          f"GiB on the machine of {available / GiB:.1f} GiB available; then: {message}")
