"""Flattened forward inputs for one step, built from the runner's request mirrors and a StepPlan.

All scheduled tokens of all requests are concatenated into one [T] batch. Attention gets, per
sequence, where its queries sit in the batch, which cache slots hold its context and the causal
mask for a multi-token chunk. `sample_rows` are the batch rows whose logits are needed.

A verify chunk (speculative decoding: the chunk's `draft_ids`) is not a prompt chunk: each of its rows is a decode
row over its own context (the K/V of every row are stored before any row attends), so each row is computed as a
one-token step would compute it, and every row is sampled (its request id once per row in `sample_request_ids`).

A chunk with `prompt_rows` also wants the logits of its rows before the prompt's last token (`logit_rows`, each with
its request, the position it predicts and that position's token in `logit_targets`); an embedding chunk
(`hidden_rows`) wants the final-norm hidden states of all its rows and no logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from allspark_server.compute.device_kind import in_host_memory
from allspark_server.compute.lora_slots import LoraRows


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
    seqs: list[SeqAttention]         # multi-token chunks (prefill), attended one by one
    decode_rows: torch.Tensor        # [B] long: batch rows of the one-token (decode) sequences
    decode_spans: torch.Tensor       # [B, max spans] long: their span tables (padded with 0)
    decode_ctx: torch.Tensor         # [B] long: their context lengths (new token included)
    # the multi-token chunks again as one varlen batch (the GPU's prefill kernel): rows, lengths, span tables
    prefill_q_start: torch.Tensor | None = None   # [N] long: first batch row of chunk i
    prefill_q_len: torch.Tensor | None = None     # [N] long: its tokens
    prefill_ctx: torch.Tensor | None = None       # [N] long: its context (cached + new tokens)
    prefill_spans: torch.Tensor | None = None     # [N, max spans] long: its span table (padded with 0)
    prefill_max_q: int = 0                        # the longest chunk (sizes the kernel's grid)


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    attn: AttentionMetadata
    sample_rows: torch.Tensor        # [N] long
    sample_request_ids: list[int]
    verifies: bool = False           # a verify chunk is among the rows: every row takes the native GEMV (decoder.py)
    lora_rows: Optional[LoraRows] = None    # the rows' LoRA adapters (compute/lora_slots.py); None: no row uses one
    logit_rows: Optional[torch.Tensor] = None    # [P] long: rows whose logits are wanted besides the sampled ones
    logit_targets: tuple = ()                    # (request id, position, token id) each logit row predicts
    hidden_rows: Optional[torch.Tensor] = None   # [E] long: rows whose final-norm hidden states are wanted
    hidden_request_ids: tuple = ()               # their requests
    # prompts with images (core/multimodal.py): M-RoPE positions [3, T] when a row's components differ, and the
    # rows whose token embeddings the images' embeddings replace
    rope_positions: Optional[torch.Tensor] = None
    embed_rows: Optional[torch.Tensor] = None    # [E] long
    embed_values: Optional[torch.Tensor] = None  # [E, hidden]

    @property
    def has_extra_rows(self) -> bool:
        return bool(self.logit_targets or self.hidden_request_ids)

    def to(self, device: torch.device) -> "ForwardInputs":
        """The same inputs with every tensor on `device` (a GPU rank's copy): host tensors (all long) packed into
        one buffer and sent with one copy, each a view of it there (a copy from pageable memory costs tens of
        microseconds of host time whatever its size)."""
        if in_host_memory(device):
            return self
        a = self.attn   # seqs stay on the host: the GPU attends chunks through the prefill_* tensors
        moved = iter(move_together([self.input_ids, self.positions, a.slot_mapping, a.decode_rows, a.decode_spans,
                                    a.decode_ctx, a.prefill_q_start, a.prefill_q_len, a.prefill_ctx,
                                    a.prefill_spans, self.sample_rows, self.logit_rows, self.hidden_rows], device))
        ids, positions = next(moved), next(moved)
        attn = AttentionMetadata(next(moved), a.seqs, *(next(moved) for _ in range(7)), a.prefill_max_q)
        lora = None if self.lora_rows is None else self.lora_rows.to(device)
        sample_rows = next(moved)
        logit_rows, hidden_rows = next(moved), next(moved)
        images = {}
        if self.rope_positions is not None or self.embed_rows is not None:
            images = {k: None if t is None else t.to(device, non_blocking=True) for k, t in
                      (("rope_positions", self.rope_positions), ("embed_rows", self.embed_rows),
                       ("embed_values", self.embed_values))}
        return ForwardInputs(ids, positions, attn, sample_rows, self.sample_request_ids, self.verifies, lora,
                             logit_rows, self.logit_targets, hidden_rows, self.hidden_request_ids, **images)


def move_together(tensors: list, device: torch.device) -> list:
    """Host tensors (or None) on `device` through one host-to-device copy when they are all long host tensors
    (each a view of one buffer, starting on a 16-byte boundary as a lone allocation would: Triton specializes its
    kernels on pointer alignment), else one copy each."""
    present = [t for t in tensors if t is not None]
    if not all(t.dtype == torch.long and in_host_memory(t) for t in present):
        return [None if t is None else t.to(device, non_blocking=True) for t in tensors]
    pieces, starts, end = [], [], 0
    for t in present:
        starts.append(end)
        pieces.append(t.reshape(-1))
        end += t.numel()
        if end % 2:                     # pad to a multiple of 2 longs: the next view starts 16-byte aligned
            pieces.append(torch.zeros(1, dtype=torch.long))
            end += 1
    flat = torch.cat(pieces).to(device, non_blocking=True) if pieces else None
    views = iter(flat[s:s + t.numel()].view(t.shape) for s, t in zip(starts, present))
    return [None if t is None else next(views) for t in tensors]


@dataclass
class RequestMirror:
    """What a runner knows about one request: its tokens, its spans, how much is cached."""
    token_ids: list[int]
    span_ids: list[int]
    num_computed_tokens: int
    lora_slot: int = -1               # its LoRA adapter's slot (-1: the base model)
    images: Any = None                # core/multimodal.py's PromptImages (a prompt with images), else None


def build_forward_inputs(chunks, mirrors: dict[int, RequestMirror], span_size: int) -> ForwardInputs:
    ids, positions, slot_list, seqs, sample_rows, sample_rids = [], [], [], [], [], []
    dec_rows, dec_spans, dec_ctx = [], [], []
    pre_spans, row_slots = [], []
    logit_rows, logit_targets, hidden_rows, hidden_rids = [], [], [], []
    offsets = None   # token offsets within a span, made by the first prefill chunk
    image_chunks = []   # (first row, start, end, PromptImages): chunks computing prompt tokens of prompts with images
    for chunk in chunks:
        m = mirrors[chunk.request_id]
        start, n = m.num_computed_tokens, chunk.num_tokens
        end = start + n
        row_slots.extend([m.lora_slot] * n)     # a verify chunk: n = 1 + len(draft_ids) rows too
        if chunk.draft_ids:   # a verify step: the last known token and the proposal, each a decode row
            for i, token in enumerate((m.token_ids[start], *chunk.draft_ids)):
                pos = start + i
                ids.append(token)
                positions.append(pos if m.images is None else m.images.position(pos))
                slot_list.append(m.span_ids[pos // span_size] * span_size + pos % span_size)
                dec_rows.append(len(ids) - 1)
                dec_spans.append(m.span_ids)
                dec_ctx.append(pos + 1)
                sample_rows.append(len(ids) - 1)
                sample_rids.append(chunk.request_id)
            continue
        ids.extend(m.token_ids[start:end])
        first = len(ids) - n                   # the chunk's first batch row
        if m.images is None:
            positions.extend(range(start, end))
        else:
            positions.extend(map(m.images.position, range(start, end)))
            if start < m.images.rope_positions.shape[1]:
                image_chunks.append((first, start, end, m.images))
        if chunk.prompt_rows:   # pending prompt logprobs: the mirror's tokens are the prompt
            for pos in range(start, min(end, len(m.token_ids) - 1)):
                logit_rows.append(first + pos - start)
                logit_targets.append((chunk.request_id, pos + 1, m.token_ids[pos + 1]))
        if chunk.hidden_rows:
            hidden_rows.extend(range(first, len(ids)))
            hidden_rids.extend([chunk.request_id] * n)
        if n == 1:   # decode: attended by one batched call over span tables
            slot_list.append(m.span_ids[start // span_size] * span_size + start % span_size)
            dec_rows.append(len(ids) - 1)
            dec_spans.append(m.span_ids)
            dec_ctx.append(end)
        else:
            spans = torch.tensor(m.span_ids, dtype=torch.long)
            if offsets is None:
                offsets = torch.arange(span_size)
            all_slots = (spans[:, None] * span_size + offsets[None, :]).reshape(-1)[:end]   # [ctx]
            slot_list.extend(all_slots[start:end].tolist())
            mask = None
            if start > 0:
                q_pos = torch.arange(start, end)[:, None]
                mask = torch.arange(end)[None, :] <= q_pos                                  # [q, ctx]
            seqs.append(SeqAttention(len(ids) - n, n, all_slots, mask, is_causal=start == 0))
            pre_spans.append(m.span_ids[:-(-end // span_size)])
        if chunk.needs_sample:
            sample_rows.append(len(ids) - 1)
            sample_rids.append(chunk.request_id)
    positions = torch.tensor(positions, dtype=torch.long)
    return ForwardInputs(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        attn=AttentionMetadata(torch.tensor(slot_list, dtype=torch.long), seqs,
                               decode_rows=torch.tensor(dec_rows, dtype=torch.long),
                               decode_spans=padded_table(dec_spans),
                               decode_ctx=torch.tensor(dec_ctx, dtype=torch.long),
                               prefill_q_start=torch.tensor([sq.q_start for sq in seqs], dtype=torch.long),
                               prefill_q_len=torch.tensor([sq.q_len for sq in seqs], dtype=torch.long),
                               prefill_ctx=torch.tensor([sq.context_slots.shape[0] for sq in seqs], dtype=torch.long),
                               prefill_spans=padded_table(pre_spans),
                               prefill_max_q=max((sq.q_len for sq in seqs), default=0)),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        sample_request_ids=sample_rids,
        verifies=any(c.draft_ids for c in chunks),
        lora_rows=LoraRows.of(row_slots),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long) if logit_rows else None,
        logit_targets=tuple(logit_targets),
        hidden_rows=torch.tensor(hidden_rows, dtype=torch.long) if hidden_rows else None,
        hidden_request_ids=tuple(hidden_rids),
        **(image_inputs(image_chunks, positions) if image_chunks else {}),
    )


def image_inputs(image_chunks: list, positions: torch.Tensor) -> dict:
    """ForwardInputs' M-RoPE positions and image embedding rows for the chunks that compute prompt tokens of prompts
    with images; every other row turns with its 1-D position in all three sections."""
    rope = positions.repeat(3, 1)                                       # [3, T]
    rows, values = [], []
    for first, start, end, images in image_chunks:
        upto = min(end, images.rope_positions.shape[1])
        rope[:, first:first + upto - start] = images.rope_positions[:, start:upto]
        at = images.embed_positions
        inside = (at >= start) & (at < end)
        rows.append(at[inside] - start + first)
        values.append(images.embeds[inside])
    positions.copy_(rope[0])                                            # the temporal component, as 1-D position
    found = torch.cat(rows)
    return {"rope_positions": rope, "embed_rows": found if len(found) else None,
            "embed_values": torch.cat(values) if len(found) else None}


def padded_table(rows: list[list[int]]) -> torch.Tensor:
    """Span tables as one [N, longest] long tensor, short rows padded with span 0 (never read past a row's
    context)."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)
