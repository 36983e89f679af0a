"""Flattened forward inputs for one step, built from the runner's request mirrors and a StepPlan.

All scheduled tokens of all requests are concatenated into one [T] batch. Attention gets, per
sequence, where its queries sit in the batch, which cache slots hold its context and the causal
mask for a multi-token chunk. `sample_rows` are the batch rows whose logits are needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SeqAttention:
    q_start: int
    q_len: int
    context_slots: torch.Tensor      # [ctx] long: cache slots of every token up to the last query
    mask: Optional[torch.Tensor]     # [q, ctx] bool (True = attend); None: no mask or plain causal
    is_causal: bool = False          # a chunk starting at position 0: ordinary causal attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] long: where this step's K/V go
    seqs: list[SeqAttention]


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    attn: AttentionMetadata
    sample_rows: torch.Tensor        # [N] long
    sample_request_ids: list[int]


@dataclass
class RequestMirror:
    """What a runner knows about one request: its tokens, its spans, how much is cached."""
    token_ids: list[int]
    span_ids: list[int]
    num_computed_tokens: int


def build_forward_inputs(chunks, mirrors: dict[int, RequestMirror], span_size: int) -> ForwardInputs:
    ids, positions, slots, seqs, sample_rows, sample_rids = [], [], [], [], [], []
    offsets = torch.arange(span_size)
    for chunk in chunks:
        m = mirrors[chunk.request_id]
        start, n = m.num_computed_tokens, chunk.num_tokens
        end = start + n
        ids.extend(m.token_ids[start:end])
        positions.extend(range(start, end))
        spans = torch.tensor(m.span_ids, dtype=torch.long)
        all_slots = (spans[:, None] * span_size + offsets[None, :]).reshape(-1)[:end]   # [ctx]
        slots.append(all_slots[start:end])
        mask = None
        if n > 1 and start > 0:
            q_pos = torch.arange(start, end)[:, None]
            mask = torch.arange(end)[None, :] <= q_pos                                      # [q, ctx]
        seqs.append(SeqAttention(len(ids) - n, n, all_slots, mask, is_causal=n > 1 and start == 0))
        if chunk.needs_sample:
            sample_rows.append(len(ids) - 1)
            sample_rids.append(chunk.request_id)
    return ForwardInputs(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        attn=AttentionMetadata(torch.cat(slots) if slots else torch.empty(0, dtype=torch.long), seqs),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        sample_request_ids=sample_rids,
    )
