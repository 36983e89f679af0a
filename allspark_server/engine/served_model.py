"""ServedModel: one installed model on rank 0 — scheduler, runner, sampler and its live requests.

It has no thread of its own: the process's EngineThread applies commands to it and calls `step()`.
A step plans (scheduler), broadcasts the plan to the other ranks, runs it (runner), samples and
pushes each new token to its request's ResultQueue (a GPU rank: once the next step is launched). How the steps
follow each other is one of two loops chosen at install (engine/step_loops.py): one step at a time, or overlapped
(GPU graphs: the next decode step is launched from this step's sampled ids on the GPU before the host reads them).
Requests with a response_format have their token masks computed before the step (a GPU rank: on a background thread
while the step runs) and applied by the sampler (guided.py); their grammar state lives here, on rank 0 only.
Stats may be read from any thread.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Optional

from allspark_client import settings
from allspark_client.config import AsModelConfig
from allspark_client.response_format import ResponseFormat
from allspark_client.types import AsEngineStat, AsStatus, GeneratedElements, GenerateRequestStatus
from allspark_client.validation import ConfigError
from allspark_server.core.adapter_table import AdapterTable
from allspark_server.core.messages import StepMsg
from allspark_server.core.prefix_cache import HostTier, PrefixCache
from allspark_server.core.request import FinishReason
from allspark_server.core.scheduler import Scheduler, SchedulerConfig
from allspark_server.core.span_manager import SpanManager
from allspark_server.engine.commands import AddRequest, Command
from allspark_server.engine.row_results import attach_rows, take_rows
from allspark_server.engine.step_loops import LaunchedStep, OverlappedLoop, SerialLoop
from allspark_server.engine.step_watchdog import StepWatchdog
from allspark_server.runner.guided import GuidedState, GuidedVocabulary
from allspark_server.runner.model_runner import ModelRunner
from allspark_server.runner.sampler import PendingSample, Sampler, plain_greedy
from allspark_server.speculative.speculation import emitted_results, make_speculation, step_rows

log = logging.getLogger(__name__)
RATE_WINDOW_S = 10.0


class ServedModel:
    def __init__(self, cfg: AsModelConfig, runner: ModelRunner, comm, watchdog: Optional[StepWatchdog] = None):
        self.cfg, self.comm = cfg, comm
        self.watchdog = watchdog                          # a pool's: times each step (step_watchdog.py)
        self.runner = runner
        cache = None
        if cfg.enable_prefix_cache:   # keyed by what shapes a span's K/V besides its tokens
            salt = f"{cfg.model_path}|{cfg.weights_path}|{runner.dtype}|{runner.kv_mode}"
            cache = PrefixCache(salt, cfg.cache_span_size, cfg.prefix_cache_ttl,
                                tier=HostTier(runner.tier_slots) if runner.tier_slots else None)
        self.spans = SpanManager(runner.num_spans, cfg.cache_span_size, cache)
        self.scheduler = Scheduler(SchedulerConfig(cfg.engine_max_batch, cfg.max_prefill_tokens), self.spans)
        self.sampler = Sampler(runner.device_kind)        # the device picks its draw (sampler.py)
        self.started = False
        self.asleep = False        # unload_device_mem freed its memory: requests are refused (engine/sleep.py)
        self._live: dict[int, AddRequest] = {}          # engine thread only
        self._rates: deque[tuple[float, int, int]] = deque()   # (time, generated, processed) per step
        self._decode_steps: deque[tuple[float, int, float]] = deque()  # (time, context tokens, seconds) per decode step
        self._stat_lock = threading.Lock()
        self._guided: Optional[GuidedVocabulary] = None   # built by the first guided request
        self._guided_lock = threading.Lock()
        # GPU ranks hand a step's tokens to their queues after the next step's model launch (deliver), so the
        # consumers they wake take the GIL while the GPU computes, not while the host prepares the next step
        self._defer_delivery = runner.device_kind.defers_delivery
        self._undelivered: list[tuple] = []   # (queue, elements, status, finished, note) of the last step
        # how it steps, chosen once: overlapped where decode steps replay from CUDA graphs (a pool of GPU ranks sends
        # the in-flight tokens to the others by NCCL broadcast), else one step at a time (engine/step_loops.py)
        self.loop = OverlappedLoop() if runner.graphs is not None and settings.OVERLAP.get() else SerialLoop()
        self._last_completed = 0.0
        # speculative decoding (speculative/speculation.py): proposals before each plan, verify rows after
        self.speculation = make_speculation(cfg, runner)
        self.adapters = AdapterTable(cfg.lora_max_num)      # loaded LoRA adapters by name (engine/lora_api.py)

    def guided_state(self, fmt: ResponseFormat) -> GuidedState:
        """A new request's grammar state (any thread); ConfigError(PARAM_ERROR) when the format does not compile
        or the model came without a tokenizer."""
        with self._guided_lock:
            if self._guided is None:
                mf = self.runner.model_file
                try:
                    self._guided = GuidedVocabulary(mf.tokenizer_json, self.runner.args.vocab_size, mf.eos_token_ids)
                except ValueError as e:
                    raise ConfigError(f"response_format needs the model's tokenizer: {e}",
                                      AsStatus.ALLSPARK_PARAM_ERROR) from None
        return self._guided.new_state(fmt)

    def close(self) -> None:
        for part in (self._guided, self.speculation):
            if part is not None:
                part.close()

    @property
    def has_work(self) -> bool:
        return self.loop.in_flight is not None or (self.started and self.scheduler.has_work())

    def stop_all(self, error: Optional[str] = None) -> None:
        """End every live request: stopped (GenerateFinished), or InternalError with `error`."""
        for rid in list(self._live):
            self._finish(rid, FinishReason.STOPPED, error=error)

    def interrupt_all(self, note: str) -> None:
        """End every live request GenerateInterrupted, saying why (`note`): the model goes to sleep."""
        for rid in list(self._live):
            self._finish(rid, FinishReason.INTERRUPTED, note=note)

    def apply(self, cmd: Command) -> None:
        if isinstance(cmd, AddRequest):
            self._live[cmd.request.request_id] = cmd
            self.scheduler.add(cmd.request)
        else:
            self.deliver()   # what the request already produced, before the stop is acknowledged
            if cmd.request_id in self._live:
                self._finish(cmd.request_id, FinishReason.STOPPED)
            cmd.done.set()

    def _finish(self, rid: int, reason: FinishReason, error: Optional[str] = None,
                note: Optional[str] = None) -> None:
        self.deliver()   # its earlier tokens first
        entry = self._live.pop(rid, None)
        if entry is None:
            return
        if self.speculation is not None:
            self.speculation.forget(rid)
        self.scheduler.finish(entry.request, reason)
        if error is not None:
            status = GenerateRequestStatus.InternalError
        elif reason == FinishReason.INTERRUPTED:
            status = GenerateRequestStatus.GenerateInterrupted
        else:
            status = GenerateRequestStatus.GenerateFinished
        entry.queue._set_status(status, error if error is not None else note)

    def _watched(self, plan):
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.step(plan.step_id, sum(c.num_tokens for c in plan.chunks))

    def step(self) -> None:
        """One call of the engine thread: the loop chosen at install does the work (engine/step_loops.py)."""
        self.loop.step(self)

    def plan_and_launch(self) -> Optional[LaunchedStep]:
        """Schedule the next step and launch it; the previous step's tokens are delivered while it runs. None when
        there is nothing to run or the launch failed (its requests ended with the error)."""
        started = time.perf_counter()
        drafts = (self.speculation.propose(self.scheduler.running, self._live.__getitem__, bool(self.scheduler.waiting))
                  if self.speculation else None)
        plan, interrupted = self.scheduler.schedule(drafts)
        if interrupted or not plan.has_work:
            self.deliver()
        for req in interrupted:
            entry = self._live.pop(req.request_id)
            entry.queue._set_status(GenerateRequestStatus.GenerateInterrupted,
                                    f"request needs more KV cache than the whole cache holds "
                                    f"({self.spans.num_spans} spans of {self.spans.span_size} tokens)")
        if not plan.has_work:
            return None
        step = self.launch(plan, started)
        if step is not None:
            self.deliver()   # the previous step's tokens, while this one runs on the GPU
        return step

    def continue_in_flight(self, prev: LaunchedStep) -> tuple[bool, Optional[LaunchedStep]]:
        """Launch the decode step that continues `prev` (still in flight) with `prev`'s tokens as its input ids, if
        the scheduler can plan it without them: (False when the launch failed, the new step or None)."""
        plan = self.scheduler.continue_decodes(prev.plan) if self.may_run_ahead(prev) else None
        if plan is None:
            return True, None
        step = self.launch(plan, time.perf_counter(), prev.pending.tokens, behind=prev)
        return step is not None, step

    @staticmethod
    def plain_greedy_whatever_comes(step: LaunchedStep) -> bool:
        """Every row plain greedy already before the previous step's token is counted (so after it too): its
        sampling is one argmax whatever that token is. (Steps that run ahead have no guided rows.)"""
        return all(plain_greedy(e.sampling.gen, e.request.num_tokens) for e in map(step.entries.get, step.rids))

    def may_run_ahead(self, step: LaunchedStep) -> bool:
        """A GPU decode step replayed from the CUDA graphs with no guided request may leave its tokens on the GPU
        for the next step (the overlapped loop), unless the next step may verify proposals, which the host makes
        from the tokens (speculation.py: while few requests run, none of which waits in its back-off)."""
        if not step.graph or not all(rid in self._live and self._live[rid].sampling.guided is None
                                     for rid in step.rids):
            return False
        spec = self.speculation
        return spec is None or len(self.scheduler.running) > spec.max_batch or spec.wait_out_next(step.rids)

    def launch(self, plan, started: float, tokens=None, behind: Optional[LaunchedStep] = None
                ) -> Optional[LaunchedStep]:
        """Broadcast the plan and run the model: the step with its logits on the device, or None if it failed
        (its requests, and `behind`'s, have ended with the error)."""
        for c in plan.chunks:
            self._live[c.request_id].queue._mark_scheduled()
        entries = {c.request_id: self._live[c.request_id] for c in plan.chunks}
        graph = self.runner.replays_graph(plan.chunks, any(e.request.lora_slot >= 0 for e in entries.values()))
        try:
            with self._watched(plan):
                self.comm.bcast(StepMsg(self.cfg.model_name, plan))
                masks = self._start_guided_masks(plan)
                logits, rids = self.runner.execute(plan, tokens)
                take_rows(self._live, self.runner.last_rows)    # prompt logprobs', embeddings' rows, if any
        except Exception as e:   # a failed step fails its requests, not the engine
            self._fail([plan] + ([behind.plan] if behind else []), e)
            return None
        return LaunchedStep(plan, rids, entries, started, graph, logits, masks)

    def sample(self, step: LaunchedStep) -> bool:
        """Start sampling the step's rows (on a GPU nothing waits for the model here); False if it failed."""
        if not step.rids:
            step.pending = PendingSample(None, results=[])
            return True
        try:
            rows = step_rows(step.plan.chunks, step.rids, step.entries)
            masks = step.masks
            if masks is not None:
                masks = (masks[0], masks[1].result())
            prof = self.runner.profiler
            start = prof.mark() if prof is not None else None
            step.pending = self.sampler.start_rows(step.logits, rows, masks)
            if prof is not None:
                prof.add("sample", start, in_step=True)
        except Exception as e:
            self._fail([step.plan], e)
            return False
        step.logits = step.masks = None
        return True

    def _fail(self, plans, e: Exception) -> None:
        self.deliver()
        log.error("step %s failed: %s", ", ".join(str(p.step_id) for p in plans), traceback.format_exc())
        if self.comm.world_size > 1:
            self.comm.abort(1)   # ranks may now disagree about the cache: the pool must die
        for plan in plans:
            for c in plan.chunks:
                self._finish(c.request_id, FinishReason.STOPPED, error=f"internal error: {e!r}")

    def complete(self, step: LaunchedStep) -> None:
        """Read the step's sampled tokens (the wait for the GPU), apply them and queue what they produce."""
        plan = step.plan
        try:
            with self._watched(plan):
                results = emitted_results(self.speculation, step.plan.chunks, step.rids, step.pending.results())
        except Exception as e:
            self._fail([plan], e)
            return
        sampled = {rid: [res.token_id for res in emitted] for rid, emitted in results.items()}
        requests = {rid: e.request for rid, e in step.entries.items()}
        events = self.scheduler.update(plan, sampled, requests)
        generated = 0
        for req, tokens, reason in events:
            entry = self._live[req.request_id]
            generated += len(tokens)
            note = None
            if entry.sampling.guided is not None:     # one token: guided requests never speculate
                reason, note = self._advance_grammar(entry, tokens[0], reason)
            el = GeneratedElements(list(tokens), prefix_cache_len=req.prefix_cache_len or 0)
            attach_rows(entry, el)                          # prompt logprobs (once), an embedding
            if entry.sampling.gen.logprobs:
                for res in results[req.request_id][:len(tokens)]:
                    el.token_logprobs_list.append(res.logprob)
                    el.log_probs_list.append(res.top_logprobs)
            first = len(req.output_ids) == len(tokens)
            status = GenerateRequestStatus.ContextFinished if first else GenerateRequestStatus.Generating
            if reason is not None:
                self._live.pop(req.request_id)
                if self.speculation is not None:
                    self.speculation.forget(req.request_id)
            self._undelivered.append((entry.queue, el, status, reason is not None, note))
        if not self._defer_delivery or not self.scheduler.has_work():
            self.deliver()
        # a step launched while the one before it ran: its wall time starts when that one's tokens were read
        self._record_step(plan, requests, generated, max(step.started, self._last_completed))
        self._last_completed = time.perf_counter()

    def deliver(self) -> None:
        """Push the tokens (and final statuses) that the last step produced to their requests' queues."""
        pending, self._undelivered = self._undelivered, []
        for queue, el, status, finished, note in pending:
            queue._push(el, status)
            if finished:
                queue._set_status(GenerateRequestStatus.GenerateFinished, note)

    def _record_step(self, plan, requests: dict, generated: int, started: float) -> None:
        """Rates for the stats; for a decode-only step also the context tokens whose KV cache it read (new tokens
        included) and its wall time, for the MBU."""
        decode_only = all(c.num_tokens == 1 for c in plan.chunks) and plan.chunks
        if decode_only:
            ctx = sum(requests[c.request_id].num_computed_tokens for c in plan.chunks)
        with self._stat_lock:
            now = time.monotonic()
            self._rates.append((now, generated, plan.num_tokens))
            while self._rates and now - self._rates[0][0] > RATE_WINDOW_S:
                self._rates.popleft()
            if decode_only:
                self._decode_steps.append((now, ctx, time.perf_counter() - started))
            while self._decode_steps and now - self._decode_steps[0][0] > RATE_WINDOW_S:
                self._decode_steps.popleft()

    def _start_guided_masks(self, plan):
        """The token masks of the guided requests that sample this step: (their rows among the sampled rows, a future
        of the bitmask), or None. A GPU rank computes them on the guided worker thread while the model runs (its CPU
        is idle then); a CPU rank computes them here, before the step: no core is free during its step, and the
        worker thread's hand-offs cost more than the masks (ALLSPARK_GUIDED_MASKS=inline|background overrides)."""
        if self._guided is None:
            return None
        rows, states, i = [], [], 0
        for c in plan.chunks:
            if not c.needs_sample:
                continue
            state = self._live[c.request_id].sampling.guided
            if state is not None:               # never a verify chunk: one row
                rows.append(i)
                states.append(state)
            i += 1 + len(c.draft_ids)
        if not rows:
            return None
        where = settings.GUIDED_MASKS.get() or self.runner.device_kind.guided_masks_default
        if where == "background":
            return rows, self._guided.start_masks(states)
        done = Future()
        done.set_result(self._guided.fill_masks(states))
        return rows, done

    def _advance_grammar(self, entry: AddRequest, token: int, reason: Optional[FinishReason]):
        """Feed a guided request's new token to its grammar: (finish reason, a note for the caller). A grammar
        that admits nothing more ends the request (whatever its eos_token_id says); max_length reached before the
        grammar is complete ends it as usual, saying that the output is cut off."""
        state, req = entry.sampling.guided, entry.request
        if not state.accept(token):
            reason = reason or FinishReason.STOPPED
            self.scheduler.finish(req, reason)
            return reason, f"response_format: the output left the grammar ({state.error})"
        if reason is None and state.is_stopped:
            self.scheduler.finish(req, FinishReason.EOS)
            return FinishReason.EOS, None
        if reason == FinishReason.LENGTH and not state.is_accepting:
            return reason, (f"response_format: max_length ({req.max_length} tokens) was reached before the "
                            f"{entry.sampling.gen.response_format.kind} output was complete; it is cut off")
        return reason, None

    # ---- stats (any thread) ------------------------------------------------------------------
    def stat(self, queued: int = 0) -> AsEngineStat:
        """`queued`: requests accepted but still in the engine thread's inbox (pending too)."""
        s = self.scheduler
        with self._stat_lock:
            rates = list(self._rates)
            decode = list(self._decode_steps)
        # MBU: per rank, the seconds its reads take at its measured bandwidth / the steps' wall time; the pool's is
        # all bytes / all bandwidth (the ranks read in parallel)
        seconds, ctx, steps = sum(d[2] for d in decode), sum(d[1] for d in decode), len(decode)
        ranks = self.runner.rank_decode_bytes
        rank_mbu = [r.read_bytes(steps, ctx) / seconds / (r.bandwidth_gbs * 1e9) if seconds else 0.0 for r in ranks]
        bandwidth = sum(r.bandwidth_gbs for r in ranks)
        mbu = sum(m * r.bandwidth_gbs for m, r in zip(rank_mbu, ranks)) / bandwidth if bandwidth else 0.0
        gen_ps = proc_ps = 0.0
        if len(rates) >= 2:
            dt = rates[-1][0] - rates[0][0]
            if dt > 0:
                gen_ps = sum(r[1] for r in rates[1:]) / dt
                proc_ps = sum(r[2] for r in rates[1:]) / dt
        used = self.spans.num_used_spans
        total = self.spans.num_spans
        free = 0 if self.asleep else total - used    # asleep: the KV cache is freed, no span can be taken (sleep.py)
        hit, miss = s.stats.prefix_cache_hit_tokens, s.stats.prefix_cache_miss_tokens
        return AsEngineStat(
            model_name=self.cfg.model_name,
            free_token=free * self.spans.span_size,
            total_token=total * self.spans.span_size,
            pendding_request=len(s.waiting) + queued, running_request=len(s.running),
            total_generated_token=s.stats.num_generated_tokens, total_prefill_token=s.stats.num_prefill_tokens,
            generate_token_persec=gen_ps, process_token_persec=proc_ps,
            total_span=total, used_span=used, free_span=free, span_size=self.spans.span_size,
            token_usage_percentage=100.0 * used / total, num_preempted=s.stats.num_preemptions,
            prefix_cache_hit_token=hit, prefix_cache_miss_token=miss,
            prefix_cache_hit_rate=hit / (hit + miss) if hit + miss else 0.0,
            prefix_cache_miss_rate=miss / (hit + miss) if hit + miss else 0.0,
            prefix_cache_spans=self.spans.num_cached_idle,
            prefix_cache_host_spans=len(self.spans.cache.tier) if self.spans.cache and self.spans.cache.tier else 0,
            memory_bandwidth_gbs=bandwidth, memory_bandwidth_utilization=mbu, asleep=self.asleep,
            rank_memory_bandwidth_gbs=[r.bandwidth_gbs for r in ranks], rank_memory_bandwidth_utilization=rank_mbu,
            **(self.speculation.stat_fields() if self.speculation is not None else {}))
