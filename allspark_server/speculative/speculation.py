"""Speculation: rank 0's part of speculative decoding for one served model.

Before each step `propose` gives every running request that decodes and may speculate a proposal (up to k tokens
from the proposer, ngram.py or draft.py); the scheduler makes each such decode a verify chunk, whose
1 + k rows the runner computes as decode rows and the sampler samples like any rows, row i with the proposal's
first i tokens counted as the request's own (penalties, min_length and the draw's key see them). `accepted` then
keeps the rows up to the first whose sampled token is not the proposed one: that token is the model's own, and
each accepted token is exactly what the model samples after the tokens before it.

Why that is exact. Greedy: each row's token is the argmax a one-token step would take, so the output is the same
token for token. Sampling: a proposal is one token per position (no draft distribution), and row i's draw is a
draw from the model's distribution p_i; accepting the proposed token d when the draw equals it happens with
probability p_i(d), and otherwise the draw is a token of p_i conditioned on not being d: the rejection sampling of
Leviathan et al. / Chen et al. for a draft that puts all its mass on d. The emitted tokens follow the model's
distribution (tests/unit/test_speculative_sampling.py checks it by chi-square, and that a wrong rule fails it).

Who speculates: requests with gen.speculative (default on) and no response_format (their grammar would have to
follow every proposed token), while at most `max_batch` requests run: a large batch is compute-bound, and the rows
a rejected proposal costs are no longer free (docs/speculative.md gives the measurements behind the default).
A request whose proposal was rejected whole, or for which the proposer found nothing, backs off: it decodes 1, 2,
4, ... up to MAX_BACKOFF steps without proposals before it tries again, and one accepted token ends the back-off.
Text the proposer cannot predict (a random model's, or free text against a poor draft) then costs a verify step
about every MAX_BACKOFF steps instead of every step, and on a GPU the steps it waits may run ahead of the host
(served_model.may_run_ahead).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence

from allspark_client.config import AUTO_SPECULATIVE_MAX_BATCH, AsModelConfig
from allspark_server.core.request import Request
from allspark_server.runner.sample_types import SampleResult, TokenRun
from allspark_server.speculative.ngram import NgramIndex

MAX_BACKOFF = 16      # steps without proposals after repeated whole rejections, at most


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], counts: Sequence[int]) -> list[list[int]]:
        """Up to counts[i] tokens to follow requests[i]'s tokens, for each request."""

    def forget(self, request_id: int) -> None:
        """The request has ended: drop what the proposer keeps for it."""

    def close(self) -> None:
        ...


class NgramProposer:
    """Prompt lookup over each request's own prompt and output (ngram.py), an index per request."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[int, NgramIndex] = {}

    def propose(self, requests, counts):
        drafts = []
        for r, k in zip(requests, counts):
            index = self._index.get(r.request_id)
            if index is None:
                index = self._index[r.request_id] = NgramIndex(self.n_min, self.n_max)
            index.follow(r)
            drafts.append(index.propose(k))
        return drafts

    def forget(self, request_id: int) -> None:
        self._index.pop(request_id, None)

    def close(self) -> None:
        self._index.clear()


@dataclass
class SpeculationStats:
    draft_tokens: int = 0        # proposed tokens checked by a verify step
    accepted_tokens: int = 0
    verify_steps: int = 0        # request-steps that verified a proposal (each emitted its accepted tokens + 1)


class Speculation:
    def __init__(self, k: int, proposer: Proposer, max_batch: int = AUTO_SPECULATIVE_MAX_BATCH):
        self.k = k
        self.proposer = proposer
        self.max_batch = max_batch
        self.stats = SpeculationStats()
        self.skipped: Counter = Counter()          # requests that ran without it, by reason
        self._counted: set[int] = set()            # request ids whose skip reason is counted
        self._backoff: dict[int, list[int]] = {}   # request id -> [steps left to wait, the next wait]
        self._lock = threading.Lock()

    @staticmethod
    def skip_reason(entry) -> Optional[str]:
        """Why a request (a ServedModel entry: its sampling state) never speculates, or None."""
        sampling = entry.sampling
        if not sampling.gen.speculative:
            return "turned_off"
        if sampling.guided is not None:
            return "response_format"
        return None

    def propose(self, running: Iterable[Request], entry_of: Callable[[int], object],
                prompts_waiting: bool = False) -> dict[int, list[int]]:
        """The proposals for the running requests that decode next and may speculate: request id -> tokens (what
        Scheduler.schedule takes). None at all while prompt rows may join the step (`prompts_waiting`: requests
        waiting to be admitted; or a running request still in its prompt): a step with a verify chunk computes every
        row as a one-row step would (compute/row_mode.py), which on a CPU puts its prompt rows on the GEMV, each
        weight read again for every few rows, far dearer than what the proposals save."""
        running = list(running)
        if (len(running) > self.max_batch or prompts_waiting
                or any(req.num_tokens - req.num_computed_tokens != 1 for req in running)):
            return {}
        wanted, counts = [], []
        for req in running:
            if self._waits(req.request_id):
                continue
            reason = self.skip_reason(entry_of(req.request_id))
            if reason is not None:
                if req.request_id not in self._counted:
                    self._counted.add(req.request_id)
                    with self._lock:
                        self.skipped[reason] += 1
                continue
            k = min(self.k, req.max_length - req.num_tokens)   # no proposed position beyond max_length
            if k > 0:
                wanted.append(req)
                counts.append(k)
        if not wanted:
            return {}
        drafts = {}
        for req, draft in zip(wanted, self.proposer.propose(wanted, counts)):
            if draft:
                drafts[req.request_id] = draft
            else:                                          # nothing to propose: as a proposal rejected whole
                self._back_off(req.request_id)
        return drafts

    def _waits(self, request_id: int) -> bool:
        """Whether the request sits out this step's proposals (its back-off), counting the step."""
        wait = self._backoff.get(request_id)
        if wait is None or wait[0] == 0:
            return False
        wait[0] -= 1
        return True

    def _back_off(self, request_id: int) -> None:
        wait = self._backoff.setdefault(request_id, [0, 1])
        wait[0], wait[1] = wait[1], min(2 * wait[1], MAX_BACKOFF)

    def wait_out_next(self, request_ids: Iterable[int]) -> bool:
        """Whether every one of these requests waits out the next step in its back-off, so that step has no
        proposal and may be planned before this one's tokens are known (the overlapped GPU loop); if so, that step
        counts as waited for each."""
        waits = [self._backoff.get(rid) for rid in set(request_ids)]
        if not waits or not all(w is not None and w[0] > 0 for w in waits):
            return False
        for w in waits:
            w[0] -= 1
        return True

    def accepted(self, draft: Sequence[int], rows: Sequence[SampleResult], request_id: Optional[int] = None
                 ) -> list[SampleResult]:
        """A verify chunk's sampled rows (1 + len(draft)) -> the results of the tokens it emits: the rows while
        each sampled the proposed token, then the first that did not (or the last row's, all accepted). A proposal
        rejected whole starts or doubles the request's back-off; an accepted token ends it."""
        n = 0
        while n < len(draft) and rows[n].token_id == draft[n]:
            n += 1
        if request_id is not None:
            if n:
                self._backoff.pop(request_id, None)
            else:
                self._back_off(request_id)
        with self._lock:
            s = self.stats
            s.draft_tokens += len(draft)
            s.accepted_tokens += n
            s.verify_steps += 1
        return list(rows[:n + 1])

    def forget(self, request_id: int) -> None:
        self._counted.discard(request_id)
        self._backoff.pop(request_id, None)
        self.proposer.forget(request_id)

    def close(self) -> None:
        self.proposer.close()

    def stat_fields(self) -> dict:
        """The AsEngineStat fields (types.py spec_*), any thread."""
        with self._lock:
            s = self.stats
            skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
            return dict(spec_draft_tokens=s.draft_tokens, spec_accepted_tokens=s.accepted_tokens,
                        spec_emitted_tokens=s.accepted_tokens + s.verify_steps, spec_verify_steps=s.verify_steps,
                        spec_acceptance_rate=s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0,
                        spec_skipped=skipped)


def step_rows(chunks, rids: Sequence[int], entries: dict) -> list:
    """The (state, all ids, output ids) of each sampled row of a step (`rids`: the request of each row; `entries`:
    ServedModel's, by request id). A verify chunk's row i counts the proposal's first i tokens as the request's
    own. A request that ended at the step before (a stop token) still has its row: sampled, then dropped."""
    drafts = {c.request_id: c.draft_ids for c in chunks if c.draft_ids}
    rows, at = [], {}
    for rid in rids:
        e = entries[rid]
        req = e.request
        draft = drafts.get(rid)
        if draft is None:
            rows.append((e.sampling, TokenRun(req.prompt_ids, req.output_ids), req.output_ids))
            continue
        i = at[rid] = at.get(rid, -1) + 1
        mine = draft[:i]         # the proposed tokens before this row, counted as the request's own
        rows.append((e.sampling, TokenRun(req.prompt_ids, req.output_ids, mine), TokenRun(req.output_ids, mine)))
    return rows


def emitted_results(speculation: Optional[Speculation], chunks, rids: Sequence[int], results: Sequence[SampleResult]
                    ) -> dict[int, list[SampleResult]]:
    """Request id -> the results of the tokens a step emits: its row's, or a verify chunk's accepted rows."""
    out: dict[int, list[SampleResult]] = {}
    for rid, res in zip(rids, results):
        out.setdefault(rid, []).append(res)
    for c in chunks:
        if c.draft_ids and c.request_id in out:
            out[c.request_id] = speculation.accepted(c.draft_ids, out[c.request_id], c.request_id)
    return out


def make_speculation(cfg: AsModelConfig, runner) -> Optional[Speculation]:
    """The model's Speculation (rank 0), or None when its config has none."""
    k = cfg.speculative_tokens
    if not k:
        return None
    if cfg.speculative_method == "ngram":
        proposer: Proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    else:
        from allspark_server.speculative.draft import DraftProposer
        proposer = DraftProposer(cfg, runner)
    return Speculation(k, proposer, cfg.speculative_batch)
