"""Small validators shared by the config modules: each failure is a ConfigError naming the key.

Torch-free. Numbers accept Python and numpy scalars; bools are never taken for integers.
"""
from __future__ import annotations

import math
from typing import Optional

from allspark_client.types import AsStatus


class ConfigError(ValueError):
    """A configuration value is invalid; `status` is the AsStatus to report."""

    def __init__(self, message: str, status: AsStatus = AsStatus.ALLSPARK_PARAM_ERROR):
        super().__init__(message)
        self.status = status


def _check(cond: bool, message: str, status: AsStatus = AsStatus.ALLSPARK_PARAM_ERROR) -> None:
    if not cond:
        raise ConfigError(message, status)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or type(v).__name__ in ("int64", "int32")


def _int(key: str, v, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    _check(_is_int(v), f"{key} must be an integer, got {v!r} ({type(v).__name__})")
    v = int(v)
    _check(lo is None or v >= lo, f"{key} must be >= {lo}, got {v}")
    _check(hi is None or v <= hi, f"{key} must be <= {hi}, got {v}")
    return v


def _float(key: str, v, lo: float, hi: float) -> float:
    _check((isinstance(v, (int, float)) and not isinstance(v, bool)) or type(v).__name__.startswith("float"),
           f"{key} must be a number, got {v!r} ({type(v).__name__})")
    v = float(v)
    _check(math.isfinite(v) and lo <= v <= hi, f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def _token_list(key: str, v, vocab_size: Optional[int]) -> tuple[int, ...]:
    if v is None:
        return ()
    items = [v] if _is_int(v) else v
    _check(isinstance(items, (list, tuple)), f"{key} must be an int or a list of ints, got {v!r}")
    out = []
    for t in items:
        _check(_is_int(t) and 0 <= int(t) < (vocab_size or 2**63),
               f"{key} entries must be token ids in [0, {vocab_size or '2^63'}), got {t!r}")
        out.append(int(t))
    return tuple(out)
