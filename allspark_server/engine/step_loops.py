"""The two ways a served model's steps follow each other, one chosen when the model is installed.

SerialLoop: each call plans a step, launches it, samples it and completes it (reads its tokens, updates the
requests, queues what they produced). Nothing is in flight between calls. CPU ranks, and GPU ranks without graphs.

OverlappedLoop: a GPU decode step replayed from the CUDA graphs may stay in flight when a call returns, its sampled
tokens still on the GPU. The next call launches the step that continues it, with those tokens as input ids, before
the host reads them, so the GPU never waits for the host between decode steps. The step in flight is the loop's
only state, handed from one call to the next as a value.

Both drive the same operations of the ServedModel they are given (plan_and_launch, continue_in_flight, sample,
complete, deliver); neither holds requests or results of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from allspark_server.core.messages import StepPlan
from allspark_server.runner.sample_types import PendingSample


@dataclass
class LaunchedStep:
    """A step on its way: its plan, the requests of its sampled rows (in row order), its chunks' requests (taken at
    launch: a stop may end one meanwhile), the logits until sampling starts, then the pending sample."""
    plan: StepPlan
    rids: list
    entries: dict                     # request id -> AddRequest
    started: float
    graph: bool                       # replayed from the decode graphs
    logits: object = None
    masks: object = None              # guided masks: (rows, future of the bitmask), or None
    pending: Optional[PendingSample] = None


class SerialLoop:
    in_flight: Optional[LaunchedStep] = None     # never: each call completes its step

    def step(self, model) -> None:
        step = model.plan_and_launch()
        if step is not None and model.sample(step):
            model.complete(step)


class OverlappedLoop:
    def __init__(self):
        self.in_flight: Optional[LaunchedStep] = None

    def step(self, model) -> None:
        prev, self.in_flight = self.in_flight, None
        self.in_flight = self._fresh(model) if prev is None else self._behind(model, prev)

    @staticmethod
    def _fresh(model) -> Optional[LaunchedStep]:
        """Plan, launch and sample a step; leave it in flight if it may run ahead, else complete it."""
        step = model.plan_and_launch()
        if step is None or not model.sample(step):
            return None
        if model.may_run_ahead(step):
            return step
        model.complete(step)
        return None

    @staticmethod
    def _behind(model, prev: LaunchedStep) -> Optional[LaunchedStep]:
        """`prev` is on the GPU, sampled there, its tokens unread: launch the step that continues it, then read and
        apply `prev`'s tokens while the GPU computes, then sample the new step (after the update: penalties,
        min_length and draws see `prev`'s tokens). Returns the new step in flight, or None."""
        launched, step = model.continue_in_flight(prev)
        if not launched:   # the launch failed: prev's requests went with it
            return None
        # plain greedy rows do not depend on prev's tokens: sampled now, not between the wait and the next launch
        early = step is not None and model.plain_greedy_whatever_comes(step)
        if early and not model.sample(step):
            return None
        # the tokens of the step before prev: the threads they wake take the GIL while this one waits for prev
        model.deliver()
        model.complete(prev)
        if step is not None and (early or model.sample(step)):
            return step
        return None
