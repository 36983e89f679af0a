"""Request: rank 0's record of one generation request (tokens, progress, spans, stop rules).

Owns the token list (prompt + output), how many tokens have K/V in the cache, the spans held and
what the runners have already been told (`num_synced_*`), and decides when generation stops.
Sampling parameters are opaque here except the stop rules; no torch.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

_arrival_counter = itertools.count()


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    STOPPED = "stopped"        # stop_request / release_request
    INTERRUPTED = "interrupted"  # can never fit in the KV cache


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    max_length: int                      # total tokens (prompt + output) allowed
    eos_token_ids: tuple[int, ...] = ()
    stop_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    sampling: Any = None                 # GenerationConfig, read by the sampler only
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    finish_reason: Optional[FinishReason] = None
    num_computed_tokens: int = 0
    span_ids: list[int] = field(default_factory=list)
    num_synced_tokens: int = 0           # tokens the runners already mirror
    num_synced_spans: int = 0
    num_preemptions: int = 0
    prefix_keys: list = field(default_factory=list)   # prefix-cache keys of its full spans, computed so far
    num_registered_spans: int = 0        # leading spans whose prefixes are in the cache (or were offered to it)
    prefix_cache_len: Optional[int] = None   # prompt tokens the cache supplied at first admission
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    num_rolled_back: int = 0             # rejected proposals' positions the runners still count as computed
    lora_slot: int = -1                  # the LoRA adapter's slot in the runners (-1: the base model)
    cache_salt: str = ""                 # the adapter's and the images' identity in prefix-cache keys ("": none)
    images: Any = None                   # core/multimodal.py's PromptImages of a prompt with images, else None
    # the logits of every prompt row are wanted (prompt_logprobs) until the prompt is computed: no prefix-cache hit
    prompt_logprobs_pending: bool = False
    embedding: bool = False              # an embedding request: its rows' hidden states, nothing sampled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids_from(self, start: int) -> list[int]:
        """all_token_ids[start:] without building all_token_ids (a decode step's one new token)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt:]
        return self.prompt_ids[start:] + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.state == RequestState.FINISHED

    def append_token(self, token_id: int) -> Optional[FinishReason]:
        """Record a sampled token; return why generation stops now, or None to continue."""
        self.output_ids.append(token_id)
        total = self.num_tokens
        if total >= self.min_length:
            if token_id in self.eos_token_ids:
                return FinishReason.EOS
            for stop in self.stop_words_ids:
                if len(self.output_ids) >= len(stop) and tuple(self.output_ids[-len(stop):]) == stop:
                    return FinishReason.STOP_WORDS
        if total >= self.max_length:
            return FinishReason.LENGTH
        return None
