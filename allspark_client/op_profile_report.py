"""The op profile of a model (`get_op_profile` / DashInfer's `get_op_profiling_info`): its types and its table.

Every rank of a pool profiles its own steps (allspark_server/compute/op_profile.py); `OpProfileReport` holds each
rank's rows as they are, and `table()` prints them with DashInfer's columns (rank, opname, count, min_ms, max_ms,
ave_ms, total_ms, percentage). Ranks stay apart rather than merged: they run the same ops on their own shards and
memory, and what an operator looks for there (one slow rank, allreduces waiting on it) is what a merge averages
away. Each rank's `(step)` row is the wall time of its whole steps, timed apart from the ops; `(untimed)` is what
no op covers, and percentages are of the step time. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

STEP_ROW, UNTIMED_ROW = "(step)", "(untimed)"
OFF = ("op profiling is off for model {name!r}: install it with enable_profiling=True in its runtime config "
       "(AsModelRuntimeConfigBuilder.profiling()), or with AS_PROFILE=ON or ALLSPARK_PROFILE=1 in the "
       "environment of the engine (a pool's rank 0)")
_RULE = "-" * 105


@dataclass(frozen=True)
class OpTiming:
    """One op on one rank: how often it ran and its min / max / total milliseconds."""
    rank: int
    op: str
    count: int
    min_ms: float
    max_ms: float
    sum_ms: float

    @property
    def ave_ms(self) -> float:
        return self.sum_ms / self.count if self.count else 0.0


@dataclass(frozen=True)
class RankSteps:
    """One rank's steps: how many ran (each one model forward; rank 0 adds its sampling) and their total time."""
    rank: int
    steps: int
    step_ms: float


@dataclass(frozen=True)
class OpProfileReport:
    model_name: str
    enabled: bool
    ops: tuple[OpTiming, ...] = ()
    steps: tuple[RankSteps, ...] = ()
    clock: str = ""                  # how the ops were timed (CPU: steady clock; GPU: CUDA events)

    def rank_ops(self, rank: int) -> list[OpTiming]:
        """The ops of `rank`, longest total first."""
        return sorted((o for o in self.ops if o.rank == rank), key=lambda o: (-o.sum_ms, o.op))

    def untimed_ms(self, rank: int) -> float:
        """Step time of `rank` that no op covers (negative where ops overlap the step's edges)."""
        step = next((s.step_ms for s in self.steps if s.rank == rank), 0.0)
        return step - sum(o.sum_ms for o in self.ops if o.rank == rank)

    def table(self) -> str:
        """DashInfer's op table, one block of rows per rank; the message saying how to turn profiling on when off."""
        if not self.enabled:
            return OFF.format(name=self.model_name)
        lines = [f"*** op profile of model {self.model_name!r}: {len(self.steps)} rank(s), {self.clock} ***", _RULE,
                 _row("rank", "opname", "count", "min_ms", "max_ms", "ave_ms", "total_ms", "percentage"), _RULE]
        for s in sorted(self.steps, key=lambda s: s.rank):
            pct = (lambda ms: f"{100.0 * ms / s.step_ms:.2f}") if s.step_ms > 0 else (lambda ms: "-")
            for o in self.rank_ops(s.rank):
                lines.append(_row(s.rank, o.op, o.count, f"{o.min_ms:.3f}", f"{o.max_ms:.3f}", f"{o.ave_ms:.3f}",
                                  f"{o.sum_ms:.3f}", pct(o.sum_ms)))
            untimed = self.untimed_ms(s.rank)
            lines.append(_row(s.rank, UNTIMED_ROW, "", "", "", "", f"{untimed:.3f}", pct(untimed)))
            lines.append(_row(s.rank, STEP_ROW, s.steps, "", "", f"{s.step_ms / s.steps:.3f}" if s.steps else "",
                              f"{s.step_ms:.3f}", pct(s.step_ms)))
            lines.append(_RULE)
        return "\n".join(lines) + "\n"


def _row(rank, op, count, mn, mx, ave, total, pct) -> str:
    return f"{rank!s:<6}{op!s:<22}{count!s:<10}{mn!s:<12}{mx!s:<12}{ave!s:<12}{total!s:<16}{pct!s:<10}".rstrip()
