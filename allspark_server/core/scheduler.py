"""Scheduler: continuous batching with chunked prefill and preemption by recomputation (rank 0 only).

Each `schedule()` builds one StepPlan: first every running request (decodes take one token,
unfinished prefills take a chunk), then waiting requests in arrival order, all within a token
budget, `max_batch` running requests and the free spans. When spans run out, the most recently
arrived running request is preempted: its spans are freed and it waits to be recomputed from its
prompt plus the tokens it already produced. A request that cannot fit even alone is interrupted.
`update()` applies sampled tokens. It owns request queues and span bookkeeping, no tensors.

A decode given a proposal (`schedule(drafts)`: speculation.py's, by request id) becomes a verify chunk of
1 + len(draft) tokens (cut to the budget); `update` takes the tokens it emitted, and the positions of
rejected proposals go back to the runners with the next plan (CachedRequestData.rolled_back). Only accepted tokens
are ever offered to the prefix cache.

With a prefix cache (SpanManager.cache), a request admitted from the waiting queue first takes the longest run
of cached full spans of its tokens (a hit: those tokens count as computed), and every span a step fills
completely is offered to the cache. A recomputation after preemption hits the spans it left behind. A request
whose next uncached span is being computed right now by a running request (eight chats arriving together with
one system prompt) waits for it instead of computing the same prefix again.

A request that wants rows besides the sampled one (prompt logprobs until its prompt is computed, an embedding
request) takes no cached prefix: its chunks are marked (`prompt_rows`, `hidden_rows`) and every row is computed. An
embedding request samples nothing and finishes once its input is computed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from allspark_server.core.messages import CachedRequestData, NewRequestData, ScheduledChunk, StepPlan
from allspark_server.core.request import FinishReason, Request, RequestState
from allspark_server.core.span_manager import SpanManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int
    max_num_batched_tokens: int


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    prefix_cache_hit_tokens: int = 0     # prompt tokens of first admissions taken from the cache
    prefix_cache_miss_tokens: int = 0    # ... and computed


class Scheduler:
    def __init__(self, config: SchedulerConfig, spans: SpanManager):
        self.config = config
        self.spans = spans
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._step_id = 0
        self._dropped: list[int] = []        # runner mirrors to forget in the next plan
        self._synced: set[int] = set()       # request ids the runners currently mirror
        self.cache = spans.cache             # PrefixCache or None
        self._computing: dict[bytes, int] = {}   # prefix keys of prompt spans being computed -> by which request

    # ---- queue management --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests_of_adapter(self, slot: int) -> int:
        """How many requests, waiting or running, use the LoRA adapter in `slot`."""
        return sum(r.lora_slot == slot for r in (*self.waiting, *self.running))

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Take a request out of scheduling (finished, stopped or interrupted) and free its spans."""
        if req.is_finished:
            return
        if req.state == RequestState.WAITING:
            self.waiting.remove(req)
        elif req.state == RequestState.RUNNING:
            self.running.remove(req)
        self._release_spans(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self, drafts: Optional[dict[int, list[int]]] = None) -> tuple[StepPlan, list[Request]]:
        """Plan one step. Also returns requests interrupted because they can never fit.

        Running decodes go first (one token each, or a verify chunk where `drafts` proposes tokens for them), then
        unfinished prefills, then waiting requests in arrival order, all within the token budget.
        """
        budget = self.config.max_num_batched_tokens
        self.spans.expire_cached()
        drafts = drafts or {}
        chunks: list[tuple[Request, int, tuple[int, ...]]] = []   # (request, tokens, its proposal)
        scheduled: set[int] = set()
        interrupted: list[Request] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.state != RequestState.RUNNING:
                continue                       # preempted earlier in this loop
            todo = req.num_tokens - req.num_computed_tokens
            # only a decode verifies a proposal (not a prompt's last token whose rows are wanted)
            draft = drafts.get(req.request_id, ()) if todo == 1 and not _wants_rows(req) else ()
            n = min(todo + len(draft), budget)
            if not self._reserve(req, n, scheduled):
                if req.is_finished:
                    interrupted.append(req)
                continue
            chunks.append((req, n, tuple(draft[:max(0, n - 1)])))   # a proposal longer than the budget is cut
            scheduled.add(req.request_id)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            req = self.waiting[0]
            if not self._take_cached_prefix(req):   # its prefix is being computed: take it from the cache later
                self._give_back_prefix(req)
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self.spans.spans_for_tokens(req.num_computed_tokens + n) - len(req.span_ids)
            if not self.spans.can_allocate(need):
                self._give_back_prefix(req)    # it is looked up again next time
                if not self.running:           # the whole cache is free and it still does not fit
                    self.finish(req, FinishReason.INTERRUPTED)
                    interrupted.append(req)
                    continue
                break
            self.waiting.popleft()
            if req.prefix_cache_len is None:   # first admission: what the cache saved this prompt
                req.prefix_cache_len = req.num_computed_tokens
                self.stats.prefix_cache_hit_tokens += req.num_computed_tokens
                self.stats.prefix_cache_miss_tokens += req.num_prompt_tokens - req.num_computed_tokens
            req.span_ids.extend(self.spans.allocate(need))
            for key in req.prefix_keys[req.num_registered_spans:]:
                self._computing.setdefault(key, req.request_id)
            req.state = RequestState.RUNNING
            self._insert_running(req)
            chunks.append((req, n, ()))
            budget -= n

        return self._make_plan(chunks), interrupted

    def continue_decodes(self, plan: StepPlan) -> Optional[StepPlan]:
        """The step after a decode-only `plan` whose sampled tokens the host has not seen yet (its update is still
        to come): the same requests in the same order, one token each, their input tokens on the device
        (`tokens_on_device`). None unless that is what `schedule` would plan after the update whatever the tokens
        are: no request waiting or running besides them, none ending by length at `plan`, spans free for all
        without preempting anyone. (A request whose token at `plan` turns out to be a stop computes one token for
        nothing; the update drops it.)"""
        if self.waiting or len(plan.chunks) != len(self.running):
            return None
        running = {r.request_id: r for r in self.running}
        reqs, need = [], []
        for chunk in plan.chunks:
            req = running.get(chunk.request_id)
            if req is None or chunk.num_tokens != 1 or not chunk.needs_sample:
                return None
            total = req.num_tokens
            if req.num_computed_tokens + 1 != total or total + 1 >= req.max_length:
                return None
            reqs.append(req)
            need.append(self.spans.spans_for_tokens(total + 1) - len(req.span_ids))
        if not self.spans.can_allocate(sum(need)):
            return None
        cached = []
        for req, n in zip(reqs, need):
            if n > 0:
                req.span_ids.extend(self.spans.allocate(n))
            total = req.num_tokens
            tokens = req.token_ids_from(req.num_synced_tokens) if req.num_synced_tokens < total else ()
            spans = req.span_ids[req.num_synced_spans:]   # known since the last plan (its update is done)
            if tokens or spans or req.num_rolled_back:
                cached.append(CachedRequestData(req.request_id, tuple(tokens), tuple(spans), req.num_rolled_back))
            req.num_synced_tokens, req.num_synced_spans, req.num_rolled_back = total, len(req.span_ids), 0
        self._step_id += 1
        dropped, self._dropped = tuple(self._dropped), []
        saves, loads = self.cache.take_copies() if self.cache is not None else ((), ())
        return StepPlan(self._step_id, dropped, (), tuple(cached),
                        tuple(ScheduledChunk(r.request_id, 1, True) for r in reqs), saves, loads,
                        tokens_on_device=True)

    def _take_cached_prefix(self, req: Request) -> bool:
        """Give a waiting request (no spans yet) the longest cached run of its full spans, leaving at least one
        token to compute (the step that samples needs its logits). False: its next span is being computed by a
        running request, so it should wait."""
        if self.cache is None or _wants_rows(req):   # every row is computed (what it computes is still offered)
            return True
        full = (req.num_tokens - 1) // self.spans.span_size
        keys = self.cache.keys(req.all_token_ids, full, req.prefix_keys, req.cache_salt)[:full]
        hits = self.cache.lookup(keys)
        self.spans.share(hits)
        slots = self.cache.tier_run(keys[len(hits):])
        if slots:   # the run goes on in the second tier: fresh spans, filled by copies before the step
            back = self.spans.allocate(min(len(slots), self.spans.num_free_spans))
            for slot, span, key in zip(slots, back, keys[len(hits):]):
                self.cache.load(slot, span, key)
            hits = hits + back
        req.span_ids = hits
        req.num_computed_tokens = len(hits) * self.spans.span_size
        req.num_registered_spans = len(hits)
        return len(hits) == len(keys) or keys[len(hits)] not in self._computing

    def _give_back_prefix(self, req: Request) -> None:
        """Undo _take_cached_prefix for a request that stays waiting."""
        self._release_spans(req)
        req.num_computed_tokens = 0

    def _stop_computing(self, req: Request, keys) -> None:
        for key in keys:
            if self._computing.get(key) == req.request_id:
                del self._computing[key]

    def _offer_full_spans(self, req: Request) -> None:
        """Offer the spans a step has just filled completely to the prefix cache."""
        full = req.num_computed_tokens // self.spans.span_size
        if self.cache is None or full <= req.num_registered_spans:
            return
        keys = self.cache.keys(req.all_token_ids, full, req.prefix_keys, req.cache_salt)
        for i in range(req.num_registered_spans, full):
            self.cache.register(req.span_ids[i], keys[i])
        self._stop_computing(req, keys[req.num_registered_spans:full])
        req.num_registered_spans = full

    def _reserve(self, req: Request, n: int, scheduled: set[int]) -> bool:
        """Get spans for `n` more tokens of a running request, preempting later arrivals if needed.

        Returns False if `req` itself was preempted (or interrupted, when it is alone).
        """
        need = self.spans.spans_for_tokens(req.num_computed_tokens + n) - len(req.span_ids)
        if need <= 0:
            return True                        # most decode steps: the last span has room
        while not self.spans.can_allocate(need):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.arrival_order)
            if victim is req:
                if len(self.running) == 1:
                    self.finish(req, FinishReason.INTERRUPTED)   # alone and still too big
                else:
                    self._preempt(req)
                return False
            self._preempt(victim)
        req.span_ids.extend(self.spans.allocate(need))
        return True

    def _insert_running(self, req: Request) -> None:
        idx = len(self.running)
        while idx > 0 and self.running[idx - 1].arrival_order > req.arrival_order:
            idx -= 1
        self.running.insert(idx, req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_spans(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = RequestState.WAITING
        self.stats.num_preemptions += 1
        # keep arrival order among waiting requests so earlier requests are recomputed first
        idx = 0
        while idx < len(self.waiting) and self.waiting[idx].arrival_order < req.arrival_order:
            idx += 1
        self.waiting.insert(idx, req)

    def _release_spans(self, req: Request) -> None:
        self._stop_computing(req, req.prefix_keys[req.num_registered_spans:])
        if req.span_ids:
            self.spans.free(reversed(req.span_ids))   # a prefix's last spans become the least recently used
        req.span_ids = []
        req.num_registered_spans = 0
        req.num_synced_spans = 0
        req.num_synced_tokens = 0
        req.num_rolled_back = 0                # a mirror made again starts from the counts themselves
        if req.request_id in self._synced:
            self._synced.discard(req.request_id)
            self._dropped.append(req.request_id)

    def _make_plan(self, chunks: list[tuple[Request, int, tuple[int, ...]]]) -> StepPlan:
        new, cached, out = [], [], []
        for req, n, draft in chunks:
            if req.request_id not in self._synced:
                new.append(NewRequestData(req.request_id, tuple(req.all_token_ids), tuple(req.span_ids),
                                          req.num_computed_tokens, req.lora_slot, req.images))
                self._synced.add(req.request_id)
            else:
                tokens = req.token_ids_from(req.num_synced_tokens)
                spans = req.span_ids[req.num_synced_spans:]
                if tokens or spans or req.num_rolled_back:
                    cached.append(CachedRequestData(req.request_id, tuple(tokens), tuple(spans),
                                                    req.num_rolled_back))
            req.num_synced_tokens = req.num_tokens
            req.num_synced_spans = len(req.span_ids)
            req.num_rolled_back = 0
            out.append(ScheduledChunk(req.request_id, n,
                                      not req.embedding and req.num_computed_tokens + n - len(draft) == req.num_tokens,
                                      draft, prompt_rows=req.prompt_logprobs_pending, hidden_rows=req.embedding))
        self._step_id += 1
        dropped, self._dropped = tuple(self._dropped), []
        saves, loads = self.cache.take_copies() if self.cache is not None else ((), ())
        return StepPlan(self._step_id, dropped, tuple(new), tuple(cached), tuple(out), saves, loads)

    # ---- results -----------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[int, list[int]], requests: dict[int, Request]
               ) -> list[tuple[Request, list[int], Optional[FinishReason]]]:
        """Advance computed counts and append each sampled request's new tokens: one, or after a verify step those
        of its proposal that were accepted and the model's next (speculation.py), up to where it finishes.
        Returns (request, the tokens appended, finish)."""
        events = []
        for chunk in plan.chunks:
            req = requests[chunk.request_id]
            if req.is_finished or req.state != RequestState.RUNNING:
                continue   # stopped by the user while this step ran
            prefilling = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += chunk.num_tokens - len(chunk.draft_ids)
            if prefilling:
                self.stats.num_prefill_tokens += min(chunk.num_tokens, req.num_prompt_tokens)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                req.prompt_logprobs_pending = False      # every prompt row's logits were computed
            if not chunk.needs_sample:
                self._offer_full_spans(req)
                if req.embedding and req.num_computed_tokens == req.num_tokens:   # its last rows are out
                    self.finish(req, FinishReason.EOS)
                    events.append((req, [], FinishReason.EOS))
                continue
            appended, reason = [], None
            for token in sampled[chunk.request_id]:
                if appended:                   # the token before it was an accepted proposal: its K/V are in
                    req.num_computed_tokens += 1
                appended.append(token)
                reason = req.append_token(token)
                if reason is not None:
                    break
            # the positions computed for proposals not taken: the runners' mirrors give them back next plan
            req.num_rolled_back += max(0, len(chunk.draft_ids) - (len(appended) - 1))
            self._offer_full_spans(req)
            self.stats.num_generated_tokens += len(appended)
            if reason is not None:
                self.finish(req, reason)
            events.append((req, appended, reason))
        return events

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting


def _wants_rows(req: Request) -> bool:
    """Rows besides the sampled one are wanted from every position (prompt_logprobs, embeddings): no prefix-cache
    hit can stand in for them, and no proposal is verified in their place."""
    return req.prompt_logprobs_pending or req.embedding
