"""Typed messages that rank 0 sends to every model runner (its own and, in a pool, the workers').

A StepPlan says what to compute in one step. Requests the runner has not seen arrive in full
(`NewRequestData`); requests it already mirrors arrive as diffs (`CachedRequestData`: tokens and
spans appended since the previous plan). `dropped_ids` are forgotten before anything else happens
(finished, aborted or preempted requests); then the prefix cache's second tier copies are made (saves from spans
to host slots, then loads back), then the chunks are computed. A plan with `tokens_on_device` continues the
previous decode step before its tokens have reached the host (GPU ranks, served_model.py): the same requests in
the same order, one token each, every input token the one sampled for that row by the previous step, which rank 0
sends to the other ranks on the GPUs; the mirrors learn those tokens from a later plan. A chunk with `draft_ids`
verifies proposed tokens (speculative decoding); the positions of those rejected are taken back from the mirrors'
computed counts by the next plan (`rolled_back`). No torch, no behaviour: data only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NewRequestData:
    request_id: int
    token_ids: tuple[int, ...]        # every known token: prompt + output so far
    span_ids: tuple[int, ...]
    num_computed_tokens: int          # tokens whose K/V are already in the spans
    lora_slot: int = -1               # its LoRA adapter's slot (-1: the base model)
    images: Any = None                # core/multimodal.py's PromptImages (a prompt with images), else None


@dataclass(frozen=True)
class CachedRequestData:
    request_id: int
    new_token_ids: tuple[int, ...]    # appended since the previous plan (the token sampled last step)
    new_span_ids: tuple[int, ...]
    rolled_back: int = 0              # positions a verify step computed whose proposed tokens were rejected


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: int
    num_tokens: int                   # tokens to compute this step, starting at num_computed_tokens
    needs_sample: bool                # the chunk reaches the last known token: sample the next one
    # speculative decoding: the tokens proposed after the last known one. The chunk is a verify step: the last
    # known token and these (num_tokens = 1 + len(draft_ids)), each a decode row over its own context, each sampled
    draft_ids: tuple[int, ...] = ()
    prompt_rows: bool = False         # also the logits of its rows before the last prompt token (prompt_logprobs)
    hidden_rows: bool = False         # an embedding chunk: its rows' final-norm hidden states, no logits


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    dropped_ids: tuple[int, ...]
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    chunks: tuple[ScheduledChunk, ...]  # batch order
    tier_saves: tuple[tuple[int, int], ...] = ()   # (span, host slot): evicted prefix spans to keep
    tier_loads: tuple[tuple[int, int], ...] = ()   # (host slot, span): cached prefixes coming back
    tokens_on_device: bool = False   # the chunks' input tokens: the previous step's sampled ids, on the GPU

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be copies to make: see has_work)."""
        return not self.chunks

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.tier_saves or self.tier_loads)


# ---- what rank 0 broadcasts to the worker ranks, dispatched by type --------------------------

@dataclass(frozen=True)
class InstallModelMsg:
    config: object                    # allspark_client.config.AsModelConfig


@dataclass(frozen=True)
class ReleaseModelMsg:
    model_name: str


@dataclass(frozen=True)
class DeviceMemMsg:
    """unload_device_mem (sleep=True, with where wake reads the weights from) or load_device_mem of a model."""
    model_name: str
    sleep: bool
    wake_from: str = ""


@dataclass(frozen=True)
class LoraMsg:
    """Load the adapter at `path` into `slot` of a model's runners (path "": unload the slot). Every rank answers
    with its error or None (comm.allgather_obj), so a load succeeds everywhere or nowhere."""
    model_name: str
    slot: int
    path: str = ""
    name: str = ""


@dataclass(frozen=True)
class StepMsg:
    model_name: str
    plan: StepPlan


@dataclass(frozen=True)
class OpProfileMsg:
    """Every rank answers with its op profile of the model (comm.allgather_obj of OpProfiler.snapshot)."""
    model_name: str


@dataclass(frozen=True)
class ShutdownMsg:
    pass
