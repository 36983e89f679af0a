"""Pool config files (TOML): how many ranks (or which GPUs), where rank 0 listens, which models to load at start.

Read by the launcher (the [pool] table) and by rank 0 (the [[model]] tables). Example:
launch/pool.example.toml. Torch-free.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import Optional, Union

from allspark_client.config import AsModelConfig, ConfigError

POOL_KEYS = {"ranks", "numa_nodes", "gpus", "socket", "port", "host", "allow_remote", "threads_per_rank", "mpirun",
             "step_timeout", "stream_stall_timeout", "hosts", "ranks_per_host"}
MODEL_KEYS = {"name", "graph", "weights", "max_length", "max_batch", "max_prefill_length", "span_size",
              "kv_cache_memory_bytes", "start"}


@dataclass
class ModelEntry:
    config: AsModelConfig
    start: bool = True


@dataclass
class PoolConfig:
    ranks: Optional[int] = None
    numa_nodes: Optional[list[int]] = None
    gpus: Optional[Union[list[int], str]] = None   # [0, 1] or "all": one rank per GPU (allspark-launch --gpus)
    socket: Optional[str] = None
    port: Optional[int] = None
    host: str = "127.0.0.1"
    allow_remote: bool = False
    threads_per_rank: int = 0
    mpirun: str = "mpirun"
    step_timeout: float = 0                        # seconds; 0: the watchdog's default (allspark-launch --step-timeout)
    stream_stall_timeout: float = 0                # seconds; 0: the default 30 (allspark-launch --stream-stall-timeout)
    hosts: Optional[list[str]] = None              # a multi-host pool (allspark-launch --host)
    ranks_per_host: int = 0                        # with hosts: 0 = one per NUMA node of each host
    models: list[ModelEntry] = field(default_factory=list)


def load_pool_config(path: str) -> PoolConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read pool config {path!r}: {e}") from None
    unknown = set(raw) - {"pool", "model"}
    if unknown:
        raise ConfigError(f"pool config {path!r}: unknown tables {sorted(unknown)} (expected [pool], [[model]])")
    pool = raw.get("pool", {})
    bad = set(pool) - POOL_KEYS
    if bad:
        raise ConfigError(f"pool config {path!r}: unknown [pool] keys {sorted(bad)}")
    cfg = PoolConfig(**pool)
    gpus = cfg.gpus
    if gpus is not None and gpus != "all" and not (
            isinstance(gpus, list) and gpus and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                                    for g in gpus) and len(set(gpus)) == len(gpus)):
        raise ConfigError(f"pool config {path!r}: [pool] gpus must be distinct GPU indices like [0, 1] or \"all\", "
                          f"got {gpus!r}")
    if cfg.hosts is not None and not (isinstance(cfg.hosts, list) and cfg.hosts
                                      and all(isinstance(h, str) and h and "," not in h for h in cfg.hosts)):
        raise ConfigError(f"pool config {path!r}: [pool] hosts must be a list of host names like [\"node1\", "
                          f"\"node2\"], got {cfg.hosts!r}")
    for m in raw.get("model", []):
        bad = set(m) - MODEL_KEYS
        if bad:
            raise ConfigError(f"pool config {path!r}: unknown [[model]] keys {sorted(bad)}")
        for key in ("name", "graph", "weights"):
            if key not in m:
                raise ConfigError(f"pool config {path!r}: a [[model]] lacks {key!r}")
        model_cfg = AsModelConfig(
            model_name=m["name"], model_path=m["graph"], weights_path=m["weights"],
            engine_max_length=m.get("max_length", 2048), engine_max_batch=m.get("max_batch", 32),
            engine_max_prefill_length=m.get("max_prefill_length", 0), cache_span_size=m.get("span_size", 32),
            kv_cache_memory_bytes=m.get("kv_cache_memory_bytes", 0))
        cfg.models.append(ModelEntry(model_cfg, bool(m.get("start", True))))
    return cfg
