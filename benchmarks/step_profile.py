"""Where a served model's steps spend their wall time (a benchmark diagnostic, not used by the engine).

`StepProfile(served_model)` wraps the step and its parts on that instance: the scheduler's plan (or its
continuation of a decode step whose tokens are still on the GPU), the runner (mirrors, forward inputs, the model
launch), the sampler's launch, the wait for the sampled tokens (on a GPU its time holds the GPU's work that the
host did not overlap), the scheduler's update, and the rest (queues, stats). `summary()`
gives per kind of step (decode-only by batch size, mixed) the count and the median milliseconds of each part.
`restore()` unwraps.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

from allspark_server.runner.sampler import PendingSample

PARTS = (("scheduler", "schedule"), ("scheduler", "continue_decodes"), ("runner", "execute"),
         ("sampler", "start_rows"), ("pending", "results"), ("scheduler", "update"))


class StepProfile:
    def __init__(self, served):
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._saved = []
        for owner_name, method in PARTS:
            owner = PendingSample if owner_name == "pending" else getattr(served, owner_name)
            self._wrap(owner, method, f"{owner_name}.{method}")
        self._wrap(served, "step", None)

    def _wrap(self, owner, method: str, part: str | None) -> None:
        original = getattr(owner, method)
        self._saved.append((owner, method, original))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            if part is None:
                self._current = {}
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                dt = time.perf_counter() - t
                step = self._current
                if part is None:
                    self._current = None
                    if "runner.execute" in step:   # a step that ran the model
                        step["wall"] = dt
                        self.steps.append(step)
                elif step is not None:
                    step[part] = step.get(part, 0.0) + dt
                    if method == "schedule" and result is not None:
                        step["kind"] = kind_of(result[0])
                    elif method == "continue_decodes" and result is not None:
                        step["kind"] = kind_of(result) + " ahead"
        setattr(owner, method, timed)

    def restore(self) -> None:
        for owner, method, original in self._saved:
            if isinstance(owner, type):
                setattr(owner, method, original)
                continue
            try:
                delattr(owner, method)     # the instance attribute goes: the class's method shows again
            except AttributeError:
                pass

    def summary(self) -> dict:
        groups: dict[str, list[dict]] = defaultdict(list)
        for s in self.steps:
            groups[s["kind"]].append(s)
        out = {}
        for kind, steps in sorted(groups.items()):
            row = {"steps": len(steps), "wall_ms": 1e3 * statistics.median(s["wall"] for s in steps),
                   "total_s": sum(s["wall"] for s in steps)}
            for owner_name, method in PARTS:
                name = f"{owner_name}.{method}"
                row[name + "_ms"] = 1e3 * statistics.median(s.get(name, 0.0) for s in steps)
            row["other_ms"] = row["wall_ms"] - sum(v for k, v in row.items() if k.endswith("_ms") and k != "wall_ms")
            out[kind] = row
        return out


def kind_of(plan) -> str:
    """'decode b<size>' (batch rounded up to a power of two) or 'mixed <tokens>' (rounded likewise)."""
    chunks = plan.chunks
    if chunks and all(c.num_tokens == 1 for c in chunks):
        return f"decode b{bucket(len(chunks))}"
    return f"mixed t{bucket(sum(c.num_tokens for c in chunks))}"


def bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
