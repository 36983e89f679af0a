"""ModelRunner: one rank's model shard and KV cache; executes StepPlans.

Builds the model from a serialized model file (reading only this rank's slices), proposes how many
KV spans its memory budget allows (`max_num_spans`; the pool takes the smallest over all ranks and
calls `allocate_kv`), mirrors request state from each plan and returns the logits of the rows to
sample (full vocabulary on rank 0, None on other ranks). Decides nothing.
"""
from __future__ import annotations

import logging

import torch

from allspark_client import settings
from allspark_client.config import AsModelConfig
from allspark_client.types import AsCacheMode
from allspark_server.compute import ops
from allspark_server.compute.device_choice import rank_device_kind
from allspark_server.compute.op_profile import OpProfiler, timed
from allspark_server.compute.row_mode import alone_rows, invariant_rows
from allspark_server.core.messages import StepPlan
from allspark_server.layers.rotary import fit_rotary
from allspark_server.layers.sharding import TPLayout
from allspark_server.loader.model_file import ModelFile, read_model_graph
from allspark_server.loader.rank_weights import cpu_state, device_state, read_rank_state
from allspark_server.loader.weights import quantize_layers
from allspark_server.models.decoder import model_class_and_rules
from allspark_server.runner import adapters, kv_budget
from allspark_server.runner.memory_bandwidth import DecodeBytes, bandwidth_gbs, decode_weight_bytes
from allspark_server.runner.row_outputs import StepRows, split_rows
from allspark_server.step.inputs import RequestMirror, build_forward_inputs
from allspark_server.step.kv_cache import KVCache, bytes_per_span, copy_spans

log = logging.getLogger(__name__)
# CPU ranks: the budget of every rank and model on one machine is kv_budget.py's
# GPU ranks: the auto budget takes at most this share of the GPU memory left free once the weights are loaded
# (DashInfer's BFC_MEM_RATIO plays this part); the rest is for activations, cuBLAS workspaces and graphs
AUTO_KV_GPU_FRACTION = 0.8
# the hidden size from which a speculating GPU model takes invariant rows. Below it one-row steps are latency-bound
# and the tensor-core GEMV's longer chain of loads costs them more than its one-read verify steps win back (measured
# on SmolLM2 and a 7B-wide model: docs/speculative.md, "On a GPU")
INVARIANT_MIN_HIDDEN = 2048
# ... and the verify rows (num_speculative_tokens + 1) from which any speculating GPU model takes them: alone rows cost
# a GEMV program each, and a 9-row verify step of SmolLM2 took longer alone than in invariant rows, which cost the
# same for 1 to 16 rows (docs/speculative.md, "On a GPU")
INVARIANT_MIN_VERIFY_ROWS = 9
KV_MODE_NAMES = {AsCacheMode.AsCacheDefault: None, AsCacheMode.AsCacheQuantI8: "int8",
                 AsCacheMode.AsCacheQuantU4: "uint4", AsCacheMode.AsCacheQuantFp8: "fp8"}


def speculates_in_invariant_rows(cfg: AsModelConfig, hidden_size: int) -> bool:
    """Whether a speculating model's verify rows (and so all its steps) take invariant rows on a GPU rank rather than
    alone rows: its config's speculative_rows, or for "auto" from INVARIANT_MIN_HIDDEN or INVARIANT_MIN_VERIFY_ROWS."""
    k = cfg.speculative_tokens
    if not k:
        return False
    if cfg.speculative_rows != "auto":
        return cfg.speculative_rows == "invariant"
    return hidden_size >= INVARIANT_MIN_HIDDEN or k + 1 >= INVARIANT_MIN_VERIFY_ROWS


class ModelRunner:
    def __init__(self, cfg: AsModelConfig, comm):
        self.cfg = cfg
        self.comm = comm
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        # the device is chosen here, once: what differs on it is asked of device_kind (compute/device_kind.py)
        self.device_kind = rank_device_kind(cfg.compute_unit, comm.rank)
        self.device = self.device_kind.device
        # the ISA is resolved at install (where py-cpuinfo is the source, ~1.5 s), not in the first request's TTFT
        log.info("kernels: %s", ops.describe())
        self.model_file: ModelFile = read_model_graph(cfg.model_path, cfg.weights_path)
        args = self.model_file.args
        self.args = args
        self.tp = TPLayout.for_model(args, comm.rank, comm.world_size)
        model_cls, _ = model_class_and_rules(args.architecture)
        self.dtype = self.model_file.dtype
        self.model = model_cls(args, self.tp, comm, self.dtype, max_positions=cfg.engine_max_length)
        self.quant = self.model_file.quant
        if self.quant is not None:
            float_formats = self.quant.float_formats()
            refusal = self.device_kind.float8_refusal() if float_formats else None
            if refusal:
                raise ValueError(f"{'/'.join(float_formats)} weights cannot be served here: {refusal}")
            quantize_layers(self.model, self.quant, comm.world_size)
        # each slice read from the file straight into the tensor the model keeps (loader/rank_weights.py)
        allocate = cpu_state if self.device_kind.weights_in_hugepages else device_state(self.device)
        state = read_rank_state(self.model_file, self.tp, self.model, allocate)
        self.model.load_state_dict(state, strict=True, assign=True)
        self.model.to(self.device)   # the buffers that are not loaded (rotary tables)
        self.model.eval()
        # LoRA: each projection's adapter slots, filled by load_lora (runner/adapters.py)
        self.lora_layers = adapters.attach(self.model, cfg.lora_max_num, cfg.lora_max_rank)
        self.span_size = cfg.cache_span_size
        self.kv_mode = KV_MODE_NAMES[AsCacheMode(cfg.cache_mode)]
        if self.kv_mode is not None and self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_mode {self.kv_mode} needs a float32 or bfloat16 model, not "
                             f"{str(self.dtype).replace('torch.', '')}")
        refusal = self.device_kind.float8_refusal() if self.kv_mode == "fp8" else None
        if refusal:
            raise ValueError(f"kv_cache_mode fp8 cannot be used here: {refusal}")
        if self.kv_mode == "uint4" and args.head_dim % 2:
            raise ValueError(f"kv_cache_mode uint4 packs two codes a byte: head_dim {args.head_dim} must be even")
        self.span_bytes = bytes_per_span(args.num_layers, self.span_size, self.tp.local_kv_heads, args.head_dim,
                                         self.dtype, self.kv_mode)
        self.num_spans = 0
        self.kv = None
        self.tier = None     # the prefix cache's second tier: host slots (KVCache layout), when configured
        self.tier_slots = 0
        # what a decode step reads on each rank, and its memory's bandwidth (install_runner): the MBU of the stat
        self.rank_decode_bytes: list[DecodeBytes] = []
        self.graphs = None   # GPU ranks: runner/cuda_graphs.py
        # a speculating GPU model that takes invariant rows runs every step and capture in invariant-rows mode
        # (compute/row_mode.py): its one-row steps then take the kernel whose rows a verify chunk reproduces from one
        # weight read
        self.invariant_rows = self.device_kind.has_invariant_rows_mode and (
            speculates_in_invariant_rows(cfg, args.hidden_size) or ops.batch_invariant())
        # profiling on: this rank's op timings (compute/op_profile.py), handed to the model after the graphs' capture
        self.profiler = OpProfiler(self.device) if cfg.enable_profiling else None
        self.asleep = None   # while unload_device_mem has freed the weights: what wake restores (residency.py)
        self.mirrors: dict[int, RequestMirror] = {}
        self.last_rows: StepRows | None = None   # rank 0: the last step's rows besides the sampled (row_outputs.py)

    def allocate_kv(self, num_spans: int, tier_slots: int = 0) -> None:
        """The cache; on a GPU one scratch span more (id num_spans, never handed out: the CUDA graphs' padding
        rows write there) and the decode graphs captured over it. `tier_slots`: host slots of the prefix cache's
        second tier (pinned memory on a GPU rank)."""
        self.num_spans = num_spans
        kind = self.device_kind
        self.kv = KVCache(self.args.num_layers, num_spans + kind.kv_scratch_spans, self.span_size,
                          self.tp.local_kv_heads, self.args.head_dim, self.dtype, self.kv_mode, self.device)
        if tier_slots:
            self.tier_slots = tier_slots
            self.tier = KVCache(self.args.num_layers, tier_slots, self.span_size, self.tp.local_kv_heads,
                                self.args.head_dim, self.dtype, self.kv_mode, torch.device("cpu"),
                                pinned=kind.pins_host_tiers)
        # host memory, counted against later installs on this machine: the tier always, the cache where it is RAM
        for cache in (self.kv if kind.kv_budget_from_host_ram else None, self.tier):
            if cache is not None:
                kv_budget.hold(cache)
        # no sequence outgrows the cache (served_model interrupts it): rotary rows past it would be memory that
        # grows with max_length outside the KV budget
        fit_rotary(self.model, min(self.cfg.engine_max_length, num_spans * self.span_size))
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """GPU ranks: the decode graphs over the cache (again after a wake: its pages moved). Every rank captures
        (NCCL inside); a mixture of experts routes on the host (ops.moe), which a graph cannot capture, so MoE models
        decode eagerly."""
        if self.device_kind.captures_decode_graphs and settings.CUDA_GRAPHS.get() and not self.args.moe_layers:
            from allspark_server.runner.cuda_graphs import DecodeGraphs
            self.model.profiler = None          # a capture records no op timings
            k = self.cfg.speculative_tokens
            verify = tuple((1 + k) * n for n in range(1, min(self.cfg.engine_max_batch,
                                                                 self.cfg.speculative_batch) + 1)) if k else ()
            with invariant_rows(self.invariant_rows):
                self.graphs = DecodeGraphs(self.model, self.kv, self.cfg.engine_max_batch,
                                           -(-self.cfg.engine_max_length // self.span_size), self.num_spans,
                                           self.span_size, self.device, verify)
        self.model.profiler = self.profiler

    def max_num_spans(self, share: "kv_budget.MachineShare") -> int:
        """How many spans this rank's budget allows (explicit bytes, or max_batch x max_length capped by memory):
        on a CPU rank the machine's RAM as `share` of it (kv_budget.py), on a GPU rank the GPU's free memory."""
        per_span = self.span_bytes
        if self.device_kind.kv_budget_from_host_ram:
            n = kv_budget.host_spans(self.cfg, per_span, share)
            wanted = -(-self.cfg.engine_max_length // self.span_size) * self.cfg.engine_max_batch
            if not self.cfg.kv_cache_memory_bytes and n < wanted:
                log.warning("KV cache: %d spans wanted for max_batch x max_length, the machine's budget allows %d "
                            "on each of its %d rank(s)", wanted, n, share.ranks)
            return n
        if self.cfg.kv_cache_memory_bytes:
            n = self.cfg.kv_cache_memory_bytes // per_span
            if n < 1:
                raise ValueError(f"kv cache budget {self.cfg.kv_cache_memory_bytes} bytes is smaller than one "
                                 f"span ({per_span} bytes)")
            return n
        spans_per_request = -(-self.cfg.engine_max_length // self.span_size)
        wanted = spans_per_request * self.cfg.engine_max_batch
        cap = int(self.device_kind.free_memory_bytes() * AUTO_KV_GPU_FRACTION) // per_span
        if cap < wanted:
            log.warning("KV cache: %d spans wanted for max_batch x max_length, GPU memory allows %d", wanted, cap)
        return max(1, min(wanted, cap))

    def max_tier_slots(self) -> int:
        """Host slots the prefix cache's second tier may have on this rank (prefix_cache_host_bytes)."""
        if not (self.cfg.enable_prefix_cache and self.cfg.prefix_cache_host_bytes):
            return 0
        n = self.cfg.prefix_cache_host_bytes // self.span_bytes
        if n < 1:
            raise ValueError(f"prefix_cache_host_bytes {self.cfg.prefix_cache_host_bytes} is smaller than one span "
                             f"({self.span_bytes} bytes)")
        return n

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_spans * self.span_bytes

    def execute(self, plan: StepPlan, tokens: torch.Tensor | None = None):
        """Apply the plan to the mirrors and run the model: (logits [N, V] or None, request ids). On a GPU the
        logits stay there (the sampler takes what it needs) and may be the CUDA graph's output buffer: use them
        before the next step. A plan with `tokens_on_device`: `tokens` [N] are the input ids on rank 0's GPU (the
        previous step's samples), sent from there to the other ranks' GPUs."""
        prof = self.profiler
        with invariant_rows(self.invariant_rows):
            if prof is None:
                return self._execute(plan, tokens, None)
            prof.resolve()           # a GPU's events of the steps before, those it has passed
            start = prof.mark()
            try:
                return self._execute(plan, tokens, prof)
            finally:
                prof.add_step(start)

    def _execute(self, plan: StepPlan, tokens, prof: OpProfiler | None):
        self.last_rows = None
        timed(prof, "apply_plan", self._apply_plan, plan)
        if plan.tier_saves or plan.tier_loads:
            timed(prof, "kv_tier_copy", self._copy_tier, plan)
        if plan.is_empty:
            return None, []
        chunks = plan.chunks
        if plan.tokens_on_device:   # only ever planned when the graphs run (served_model.py)
            if self.comm.rank != 0:
                tokens = torch.empty(len(chunks), dtype=torch.long, device=self.device)
            ids = timed(prof, "token_broadcast", self.comm.broadcast_, tokens)
            logits = timed(prof, "decode_graph", self.graphs.run_decode, chunks, self.mirrors, ids)
            sampled = [c.request_id for c in chunks]
        elif self.replays_graph(chunks):   # no ForwardInputs to build
            logits = timed(prof, "decode_graph", self.graphs.run_decode, chunks, self.mirrors)
            sampled = [c.request_id for c in chunks for _ in range(c.num_tokens)]   # a verify chunk: a row a token
        else:
            inputs = timed(prof, "inputs", self._forward_inputs, chunks)
            with alone_rows(inputs.verifies):        # a verify step's rows as one-row steps (compute/row_mode.py)
                logits, sampled = self.model(inputs, self.kv), inputs.sample_request_ids
            if inputs.has_extra_rows:                # prompt logprobs' or embeddings' rows too
                logits, hidden = logits
                if logits is not None:               # rank 0
                    logits, self.last_rows = split_rows(logits, hidden, len(sampled), inputs.logit_targets,
                                                        inputs.hidden_request_ids)
        for c in chunks:
            self.mirrors[c.request_id].num_computed_tokens += c.num_tokens
        return logits, sampled

    def replays_graph(self, chunks, uses_lora: bool | None = None) -> bool:
        """The step replays a CUDA graph: a decode step that fits them; where a row uses a LoRA adapter, one of the
        graphs captured with adapters (not a verify step: those run eagerly). uses_lora: whether a row does (None:
        as the mirrors, with the plan applied, say)."""
        if self.graphs is None or not self.graphs.fits_decode(chunks) \
                or any(c.prompt_rows or c.hidden_rows for c in chunks):
            return False
        if uses_lora is None:
            uses_lora = any(self.mirrors[c.request_id].lora_slot >= 0 for c in chunks)
        return not uses_lora or (self.graphs.lora_graphs is not None and not any(c.draft_ids for c in chunks))

    def adapters_changed(self) -> None:
        """After a LoRA load or unload: on a GPU with decode graphs, the adapters' stacks refilled in place, and the
        graphs with adapters captured the first time (over stacks that keep their storage from then on)."""
        if self.graphs is None:
            return
        first = self.graphs.lora_graphs is None
        if first and all(lora.is_empty for slots in self.lora_layers for lora in slots.values()):
            return
        for slots in self.lora_layers:
            for lora in slots.values():
                if first:
                    lora.fix_storage(self.dtype, self.device)
                lora.stacked()
        if first:
            self.model.profiler = None          # a capture records no op timings
            with invariant_rows(self.invariant_rows):
                self.graphs.capture_lora()
            self.model.profiler = self.profiler

    def _forward_inputs(self, chunks):
        return build_forward_inputs(chunks, self.mirrors, self.span_size).to(self.device)

    def _copy_tier(self, plan: StepPlan) -> None:
        if plan.tier_saves:
            copy_spans(self.kv, [s for s, _ in plan.tier_saves], self.tier, [t for _, t in plan.tier_saves])
        if plan.tier_loads:
            copy_spans(self.tier, [t for t, _ in plan.tier_loads], self.kv, [s for _, s in plan.tier_loads])

    def _apply_plan(self, plan: StepPlan) -> None:
        """The request mirrors: dropped requests forgotten, new ones taken in full, running ones' diffs applied."""
        for rid in plan.dropped_ids:
            self.mirrors.pop(rid, None)
        for r in plan.new_requests:
            self.mirrors[r.request_id] = RequestMirror(list(r.token_ids), list(r.span_ids), r.num_computed_tokens,
                                                       r.lora_slot, r.images)
        for r in plan.cached_requests:
            m = self.mirrors[r.request_id]
            m.token_ids.extend(r.new_token_ids)
            m.span_ids.extend(r.new_span_ids)
            m.num_computed_tokens -= r.rolled_back      # a verify step's rejected proposals


class InstallError(RuntimeError):
    pass


def _raise_failed(comm, errors: list) -> None:
    """InstallError on every rank when any rank failed (each rank's reason, by rank)."""
    failed = [f"rank {r}: {msg}" if comm.world_size > 1 else msg for r, msg in enumerate(errors) if msg]
    if len(failed) > 1 and len(set(errors)) == 1:
        failed = [f"every rank: {errors[0]}"]
    if failed:
        raise InstallError("; ".join(failed))


def install_runner(cfg: AsModelConfig, comm) -> ModelRunner:
    """Collective (every rank calls it): load this rank's shard, agree that all ranks succeeded,
    then size the KV cache to the smallest budget over the ranks."""
    runner, error = None, None
    try:
        runner = ModelRunner(cfg, comm)
    except Exception as e:   # reported to every rank below, so all give up together
        error = f"{type(e).__name__}: {e}"
    # every rank's loaded; the KV caches each holds in host memory: the ranks on one machine share its RAM
    loaded = comm.allgather_obj((error, kv_budget.usage()))
    _raise_failed(comm, [e for e, _ in loaded])
    try:
        proposal = runner.max_num_spans(kv_budget.MachineShare.of([u for _, u in loaded], comm.rank))
        slots = runner.max_tier_slots()
    except Exception as e:
        error, proposal, slots = f"{type(e).__name__}: {e}", 0, 0
    _raise_failed(comm, comm.allgather_obj(error))
    if runner.device_kind.collectives_use_nccl:
        comm.use_gpu(runner.device_kind)   # NCCL between the ranks' GPUs (every rank got here: none failed)
    runner.allocate_kv(comm.allreduce_min(proposal), comm.allreduce_min(slots))
    comm.barrier()                                    # every rank measures its bandwidth at the same time
    runner.rank_decode_bytes = comm.allgather_obj(
        DecodeBytes(decode_weight_bytes(runner.model, runner.model.model.embed_tokens.weight),
                    runner.span_bytes // runner.span_size, bandwidth_gbs(runner.device_kind)))
    return runner
