"""DraftProposer: speculative decoding's proposals from a smaller model (cfg.draft_model), run greedily in-process.

It lives on rank 0 only, a pool's too: the target's other ranks never see it. The draft is serialized into a
temporary folder at install (HF folder or GGUF file through HuggingFaceModel, as allspark-serve does, with
draft_dtype and draft_quantize applied; an `.asgraph` with its `.asparam` is used as it is) and run by a ModelRunner
of its own over a single-rank communicator, on the target's compute unit, with a KV cache of its own.

Per request it keeps a mirror of what the draft has computed. Before each target step, `propose` rolls each
request back to the longest common prefix of those tokens and the request's tokens now (the verify step rejects
proposals), computes the missing tokens as one chunk that samples its last row (up to CATCH_UP_ROWS tokens, the
usual case after a verify step, as decode rows of one sequence, the target's verify-chunk shape: a prompt chunk
would take the prefill path, which for quantized weights dequantizes every weight; a runner that decodes from CUDA
graphs takes those rows one a step instead), then takes counts[i] - 1 one-token steps: greedy argmax, every request
of the call in the same draft steps. The proposals never change the output (verification is exact, speculation.py);
a better draft only makes more of them accepted.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from collections import OrderedDict

import torch

from allspark_client.config import AsModelConfig
from allspark_client.types import AsCacheMode
from allspark_server.collective.comm import LocalComm
from allspark_server.core.messages import ScheduledChunk, StepPlan
from allspark_server.loader.hf_model import HuggingFaceModel, ModelSerializerException
from allspark_server.loader.model_file import read_model_graph
from allspark_server.models.registry import get_arch
from allspark_server.runner import kv_budget
from allspark_server.runner.model_runner import ModelRunner
from allspark_server.step.inputs import RequestMirror

log = logging.getLogger(__name__)
DRAFT_NAME = "draft"
CATCH_UP_ROWS = 16        # tokens the draft catches up on as decode rows; more (a prompt) as a prompt chunk


def serialize_draft(path: str, dtype: str, quantize: str, out_dir: str, target_vocab: int) -> tuple[str, str]:
    """(graph, weights) of the draft: an `.asgraph` (its `.asparam` beside it) as it is, else the HF folder or GGUF
    file serialized into out_dir with `dtype` ("" = the file's) and InstantQuant weight format `quantize`
    (draft_quant_config). A draft the registry does not know or whose vocabulary exceeds the target's is refused
    before any weight is read. A quantized copy has its LM head quantized too, unless asked otherwise."""
    if path.endswith(".asgraph"):
        if dtype or quantize:
            raise ValueError(f"draft_dtype / draft_quantize apply while serializing a HF folder or GGUF file; "
                             f"{path!r} is serialized already")
        graph, weights = path, path[:-len(".asgraph")] + ".asparam"
        check_draft(path, read_model_graph(graph, weights).args, target_vocab)
        return graph, weights
    try:
        loader = HuggingFaceModel(path, DRAFT_NAME, user_set_data_type=dtype or None)
        check_draft(path, loader.args, target_vocab)
        # its LM head too: a draft's step is read bandwidth, and a small model's head is a large part of it (SmolLM2's
        # fp32 head is 113 MB beside 106 MB of int8 layers); proposals need no more than the argmax to agree
        quant = draft_quant_config(quantize) if quantize else None
        loader.load_model().serialize_to_path(None, out_dir, customized_quant_config=quant).free_model()
    except ModelSerializerException as e:          # an unknown architecture too
        raise ValueError(f"draft model {path!r}: {e}") from None
    return loader.graph_path, loader.weights_path


def draft_quant_config(quantize: str) -> dict:
    """InstantQuant's config of draft_quantize: a weight format ("int8", "uint4", ...: per channel) or one in groups
    of N k ("uint4_g128"); the LM head is quantized too (above) unless the format ends in "+fp_head": a large model's
    head is a small part of its step, and its logits' ties are where a quantized copy's tokens part from the target's.
    """
    spec, plus, suffix = quantize.partition("+")
    if plus and suffix != "fp_head":
        raise ValueError(f"draft_quantize {quantize!r}: the one suffix is '+fp_head' (the LM head left unquantized)")
    fmt, grouped, group = spec.partition("_g")
    if grouped and not (group.isdigit() and int(group) > 0):
        raise ValueError(f"draft_quantize {quantize!r}: a group size after '_g' is a positive number of k "
                         f"(e.g. 'uint4_g128')")
    return {"weight_format": fmt, "quantize_lm_head": not plus, **({"group_size": int(group)} if grouped else {})}


def check_draft(path: str, args, target_vocab: int) -> None:
    get_arch(args.architecture)                    # UnsupportedArchitecture (a ValueError) names the supported ones
    if args.vocab_size > target_vocab:
        raise ValueError(f"draft model {path!r} has a vocabulary of {args.vocab_size} tokens, more than the target "
                         f"model's {target_vocab}: its proposals could not be verified")


def draft_config(cfg: AsModelConfig, graph: str, weights: str) -> AsModelConfig:
    """The draft runner's config: the target's device, span size, max_batch and max_length (its KV cache: as many
    spans as those need, capped by the memory's budget), no speculation, prefix cache or profiling of its own."""
    return dataclasses.replace(
        cfg, model_name=f"{cfg.model_name}.{DRAFT_NAME}", model_path=graph, weights_path=weights,
        kv_cache_memory_bytes=0, cache_mode=AsCacheMode.AsCacheDefault,
        enable_prefix_cache=False, prefix_cache_host_bytes=0, enable_profiling=False, speculative_method="",
        num_speculative_tokens=0, draft_model="", draft_dtype="", draft_quantize="", speculative_max_batch=0)


def catches_up_row_by_row(runner) -> bool:
    """Whether the draft computes its catch-up rows one a step: where its runner decodes from CUDA graphs, whose
    one-row replays cost far less than the eager step a verify chunk of the draft takes (only a speculating model
    captures verify graphs)."""
    return runner.graphs is not None


class DraftProposer:
    def __init__(self, cfg: AsModelConfig, runner):
        self._dir = tempfile.mkdtemp(prefix="allspark-draft-")
        try:
            self._load(cfg, runner.args.vocab_size)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def _load(self, cfg: AsModelConfig, target_vocab: int) -> None:
        graph, weights = serialize_draft(cfg.draft_model, cfg.draft_dtype, cfg.draft_quantize, self._dir, target_vocab)
        self.runner = ModelRunner(draft_config(cfg, graph, weights), LocalComm())
        self.vocab_size = self.runner.args.vocab_size
        share = kv_budget.MachineShare.of([kv_budget.usage()], 0)
        self.runner.allocate_kv(self.runner.max_num_spans(share))
        self.span_size = self.runner.span_size
        self.capacity = min(cfg.engine_max_length, self.runner.num_spans * self.span_size)   # tokens of one request
        self._free = list(range(self.runner.num_spans))
        self._used: OrderedDict[int, None] = OrderedDict()   # request ids with a mirror, least recently used first
        self._step = 0
        log.info("draft model %s: %d KV spans of %d tokens", cfg.draft_model, self.runner.num_spans, self.span_size)

    # ---- proposals ---------------------------------------------------------------------------------------------
    def propose(self, requests, counts) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        rows = []                                  # (index in requests, request id, catch-up steps, tokens wanted)
        keep = {r.request_id for r in requests}
        chunks = []
        for i, (req, k) in enumerate(zip(requests, counts)):
            chunk = self._catch_up(req.request_id, req.all_token_ids, k, keep)
            if chunk is None:
                continue
            skip = 0
            if chunk.draft_ids and catches_up_row_by_row(self.runner):
                skip, chunk = chunk.num_tokens - 1, ScheduledChunk(req.request_id, 1, True)
            chunks.append(chunk)
            rows.append((i, req.request_id, skip, k))
        step = 0
        while chunks:
            tokens = self._run(chunks)
            step += 1
            chunks = []
            for (i, rid, skip, k), token in zip(rows, tokens):
                if step > skip:              # past the catch-up rows, whose tokens are known: a proposal
                    out[i].append(token)
                    self.runner.mirrors[rid].token_ids.append(token)
                if skip + k > step:
                    chunks.append(ScheduledChunk(rid, 1, True))
            rows = [row for row in rows if row[2] + row[3] > step]
        return out

    def _catch_up(self, rid: int, ids: list[int], k: int, keep: set[int]):
        """The chunk that brings the request's mirror to its tokens `ids` (computed up to the longest common prefix,
        never the last token: its row gives the first proposal); None when the draft cannot propose for it."""
        mirror = self.runner.mirrors.get(rid)
        if len(ids) + k - 1 > self.capacity or max(ids) >= self.vocab_size:
            return None
        if mirror is None:
            mirror = self.runner.mirrors[rid] = RequestMirror([], [], 0)
        done = 0
        limit = min(mirror.num_computed_tokens, len(ids) - 1)
        while done < limit and mirror.token_ids[done] == ids[done]:
            done += 1
        mirror.token_ids[:] = ids
        mirror.num_computed_tokens = done
        self._used[rid] = None
        self._used.move_to_end(rid)
        if not self._reserve(mirror, len(ids) + k - 1, keep):
            return None
        n = len(ids) - done
        if 1 < n <= CATCH_UP_ROWS:   # a few tokens: decode rows of one sequence (a verify chunk), not a prompt chunk
            return ScheduledChunk(rid, n, True, draft_ids=tuple(ids[done + 1:]))
        return ScheduledChunk(rid, n, True)

    def _reserve(self, mirror: RequestMirror, tokens: int, keep: set[int]) -> bool:
        """Spans for `tokens` positions of the request, taken from the requests least recently proposed for (not
        those of this call) where none are free."""
        need = -(-tokens // self.span_size) - len(mirror.span_ids)
        victims = (rid for rid in list(self._used) if rid not in keep)
        while need > len(self._free):
            victim = next(victims, None)
            if victim is None:
                return False
            self.forget(victim)
        if need > 0:
            mirror.span_ids.extend(self._free[-need:])
            del self._free[-need:]
        return True

    def _run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One draft step: the greedy token of each chunk's last row."""
        self._step += 1
        with torch.inference_mode():
            logits, rids = self.runner.execute(StepPlan(self._step, (), (), (), tuple(chunks)))
            last = {rid: i for i, rid in enumerate(rids)}          # a catch-up chunk of decode rows: its last one
            return logits[[last[c.request_id] for c in chunks]].argmax(dim=-1).tolist()

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def forget(self, request_id: int) -> None:
        mirror = self.runner.mirrors.pop(request_id, None)
        self._used.pop(request_id, None)
        if mirror is not None:
            self._free.extend(mirror.span_ids)

    def close(self) -> None:
        for rid in list(self.runner.mirrors):
            self.forget(rid)
        self.runner = None                         # the weights, the cache and its graphs go with it
        shutil.rmtree(self._dir, ignore_errors=True)
