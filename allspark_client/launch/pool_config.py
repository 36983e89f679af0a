"""Pool config files (TOML): how many ranks (or which GPUs), where rank 0 listens, which models to load at start.

Read by the launcher (the [pool] table) and by rank 0 (the [[model]] tables). Example:
launch/pool.example.toml. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import tomllib

from allspark_client.config import AsModelConfig, ConfigError

POOL_KEYS = {"ranks", "numa_nodes", "gpus", "socket", "port", "host", "allow_remote", "threads_per_rank", "mpirun",
             "step_timeout", "stream_stall_timeout", "hosts", "ranks_per_host", "orphan_grace"}
MODEL_KEYS = {"name", "graph", "weights", "max_length", "max_batch", "max_prefill_length", "span_size",
              "kv_cache_memory_bytes", "start"}


def _integer(low: int, high: Optional[int] = None) -> tuple[Callable[[Any], bool], str]:
    what = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low
            and (high is None or v <= high)), what


_SECONDS = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a number of seconds >= 0")
_TEXT = (lambda v: isinstance(v, str) and v != "", "a non-empty string")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_NODES = (lambda v: isinstance(v, list) and v != [] and len(set(map(repr, v))) == len(v)
          and all(_integer(0)[0](n) for n in v), "a list of distinct NUMA node numbers like [0, 1]")
# what each key's value must be (gpus and hosts have checks of their own below)
POOL_TYPES = {"ranks": _integer(1), "numa_nodes": _NODES, "socket": _TEXT, "port": _integer(1, 65535),
              "host": _TEXT, "allow_remote": _BOOL, "threads_per_rank": _integer(0), "mpirun": _TEXT,
              "step_timeout": _SECONDS, "stream_stall_timeout": _SECONDS, "ranks_per_host": _integer(0),
              "orphan_grace": _SECONDS}
MODEL_TYPES = {"name": _TEXT, "graph": _TEXT, "weights": _TEXT, "max_length": _integer(1), "max_batch": _integer(1),
               "max_prefill_length": _integer(0), "span_size": _integer(1), "kv_cache_memory_bytes": _integer(0),
               "start": _BOOL}


def _check_types(path: str, table: str, values: dict, types: dict) -> None:
    """A wrong type or range is refused here, naming the key and the value (not a TypeError later, or a rank that
    fails seconds after a --dry-run passed)."""
    for key, value in values.items():
        ok, what = types.get(key, (lambda v: True, ""))
        if not ok(value):
            raise ConfigError(f"pool config {path!r}: {table} {key} must be {what}, got {value!r} "
                              f"({type(value).__name__})")


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
    orphan_grace: float = 0                        # seconds; 0: the default 30 (allspark-launch --orphan-grace)
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
    pool, models = raw.get("pool", {}), raw.get("model", [])
    if not isinstance(pool, dict) or not (isinstance(models, list) and all(isinstance(m, dict) for m in models)):
        raise ConfigError(f"pool config {path!r}: [pool] must be a table and each model a [[model]] table")
    bad = set(pool) - POOL_KEYS
    if bad:
        raise ConfigError(f"pool config {path!r}: unknown [pool] keys {sorted(bad)}")
    _check_types(path, "[pool]", pool, POOL_TYPES)
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
    for m in models:
        bad = set(m) - MODEL_KEYS
        if bad:
            raise ConfigError(f"pool config {path!r}: unknown [[model]] keys {sorted(bad)}")
        for key in ("name", "graph", "weights"):
            if key not in m:
                raise ConfigError(f"pool config {path!r}: a [[model]] lacks {key!r}")
        _check_types(path, "[[model]]", m, MODEL_TYPES)
        model_cfg = AsModelConfig(
            model_name=m["name"], model_path=m["graph"], weights_path=m["weights"],
            engine_max_length=m.get("max_length", 2048), engine_max_batch=m.get("max_batch", 32),
            engine_max_prefill_length=m.get("max_prefill_length", 0), cache_span_size=m.get("span_size", 32),
            kv_cache_memory_bytes=m.get("kv_cache_memory_bytes", 0))
        cfg.models.append(ModelEntry(model_cfg, m.get("start", True)))
    return cfg
