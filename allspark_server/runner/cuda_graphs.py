"""CUDA graphs for decode-only steps on a GPU rank.

At install, one decode step is captured per batch size of a ladder (1, 2, 4, 8, ... up to max_batch), all
reading the same static input buffers and sharing one memory pool (largest captured first). A decode-only
step of B sequences writes its inputs, taken straight from the runner's request mirrors, into the first rows
of those buffers, pads them up to the next size of the ladder and replays that graph: a whole step is two
copies and one launch from the host instead of a launch per kernel.
Padding rows decode token 0 at position 0 into a scratch span that no request owns (the cache holds one
span more than the span manager hands out), so they can never touch a request's keys and values.
LoRA: once a model's first adapter is loaded, the ladder is captured again with the adapters' kernels
(`capture_lora`, over adapter stacks that keep their storage: compute/lora_slots.py), each row reading its adapter slot
from one more static row (-1: none); steps with an adapter row replay those, the others the plain graphs.
Steps with a prefill chunk run eagerly. A step that continues the previous one before the host has seen its
tokens (a plan with `tokens_on_device`) takes its input ids from the device: one more copy, GPU to GPU.
The capture itself and the event that fences the copies are CUDA's (compute/cuda/graph_capture.py).
"""
from __future__ import annotations

import torch

from allspark_server.compute.cuda.graph_capture import capture_each_size, copies_done_event
from allspark_server.compute.lora_slots import LoraRows
from allspark_server.compute.row_mode import alone_rows
from allspark_server.step.inputs import AttentionMetadata, ForwardInputs


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... doubling, and max_batch itself last."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_spans_per_seq: int, scratch_span: int,
                 span_size: int, device: torch.device, verify_sizes: tuple[int, ...] = ()):
        self.model, self.kv = model, kv_cache
        self.sizes = batch_ladder(max_batch)
        # speculative verify steps: graphs of their own, captured in alone-rows mode (compute/row_mode.py), so that
        # each verify row comes out as a one-row step's; sizes: (1 + k) x requests
        self.verify_sizes = sorted(set(verify_sizes))
        max_rows = max([max_batch, *self.verify_sizes])      # the input buffers hold the largest of either
        self.scratch_span, self.scratch_slot = scratch_span, scratch_span * span_size
        long = dict(dtype=torch.long, device=device)
        # ids, positions, slots, context lengths and LoRA adapter slots of each row in one tensor, and the rows'
        # span tables: the graphs' static inputs. A step writes them on the host into pinned copies (host_*),
        # padding rows included, and sends each with one asynchronous copy.
        self.host_rows = torch.zeros(5, max_rows, dtype=torch.long, pin_memory=True)        # [5, Bmax]
        self.host_rows[2].fill_(self.scratch_slot)     # every row padding: token 0 at position 0 into the
        self.host_rows[3].fill_(1)                     # scratch span, with no adapter
        self.host_rows[4].fill_(-1)
        self.host_spans = torch.full((max_rows, max_spans_per_seq), scratch_span, dtype=torch.long,
                                     pin_memory=True)                                         # [Bmax, MAXS]
        self.per_row = self.host_rows.to(device)
        self.ids, self.positions, self.slots, self.ctx, self.lora_slots = self.per_row
        self.spans = self.host_spans.to(device)
        self.host_filled = 0   # host rows holding the last step's sequences
        # per row: the mirror whose span table it holds and how many of its spans are written (a decode step
        # rewrites a row's table only when its sequence changed or got a span)
        self.row_spans: list[tuple] = [(None, 0)] * max_rows
        self.copied = copies_done_event()   # the last step's copies are done with the host rows
        self.span_size = span_size
        self.rows = torch.arange(max_rows, **long)
        self.graphs, self.logits = self._capture(self.sizes)   # per ladder size: its graph, its logits buffer
        with alone_rows():
            self.verify_graphs, self.verify_logits = self._capture(self.verify_sizes)
        self.lora_graphs, self.lora_logits = None, None      # capture_lora

    def _inputs(self, b: int, lora: bool = False) -> ForwardInputs:
        meta = AttentionMetadata(self.slots[:b], [], self.rows[:b], self.spans[:b], self.ctx[:b])
        lora_rows = LoraRows(self.lora_slots[:b]) if lora else None
        return ForwardInputs(self.ids[:b], self.positions[:b], meta, self.rows[:b], [], lora_rows=lora_rows)

    @torch.inference_mode()
    def _capture(self, sizes: list[int], lora: bool = False) -> tuple[dict, dict[int, torch.Tensor]]:
        return capture_each_size(lambda b: self.model(self._inputs(b, lora), self.kv), sizes)

    def capture_lora(self) -> None:
        """The ladder again with the LoRA adapters' kernels (each row's slot from `lora_slots`)."""
        self.lora_graphs, self.lora_logits = self._capture(self.sizes, lora=True)

    def fits_decode(self, chunks) -> bool:
        """A decode-only step (one token per sequence, every one sampled; a speculative verify chunk counts as
        1 + len(draft) such rows, and takes a verify graph) of at most max_batch rows (span tables always fit: the
        buffer is as wide as max_length needs)."""
        if any(c.draft_ids for c in chunks):       # a verify step: only its own graphs compute rows as alone
            limit = self.verify_sizes[-1] if self.verify_sizes else 0
        else:
            limit = self.sizes[-1]
        return (sum(c.num_tokens for c in chunks) <= limit
                and all(c.needs_sample and c.num_tokens == 1 + len(c.draft_ids) for c in chunks))

    def run_decode(self, chunks, mirrors, device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode-only step (fits_decode) from the runner's mirrors (step/inputs.py): the fp32 logits
        [B, V] of its B rows (a verify chunk's rows: its last known token and each proposed one, a decode row over
        its own context, as step/inputs.py builds them), a view of the graph's output (read it before the next
        step); None on the ranks other than 0 of a pool (the LM head gathers to rank 0). `device_ids` [B]: the
        rows' input tokens, on the GPU (the mirrors do not hold them yet; never with verify chunks)."""
        b = sum(c.num_tokens for c in chunks)
        verifies = any(c.draft_ids for c in chunks)
        size = next(s for s in (self.verify_sizes if verifies else self.sizes) if s >= b)
        if not self.copied.query():   # the last step's copies have read the pinned rows (done long ago, mostly:
            self.copied.synchronize()  # the query keeps the GIL, a wait would give it away)
        rows, spans, p = self.host_rows.numpy(), self.host_spans.numpy(), self.span_size
        ids, positions, slots, ctx, adapters = [], [], [], [], []
        for chunk in chunks:
            m = mirrors[chunk.request_id]
            start = m.num_computed_tokens
            adapters += [m.lora_slot] * chunk.num_tokens
            for j, pos in enumerate(range(start, start + chunk.num_tokens)):
                i = len(ids)
                need = pos // p + 1                    # spans holding positions 0..pos
                ids.append(0 if device_ids is not None else m.token_ids[pos] if j == 0 else chunk.draft_ids[j - 1])
                positions.append(pos if m.images is None else m.images.position(pos))   # M-RoPE: text after images
                slots.append(m.span_ids[need - 1] * p + pos % p)
                ctx.append(pos + 1)
                held, written = self.row_spans[i]
                if held is not m:                      # another sequence in this row: its whole table
                    written = 0
                if written < need:                     # a mirror's spans only grow: write the new ones
                    spans[i, written:need] = m.span_ids[written:need]
                    self.row_spans[i] = (m, need)
        rows[:, :b] = (ids, positions, slots, ctx, adapters)
        lora = any(s >= 0 for s in adapters)    # replays_graph let it here only with the adapters' graphs
        if self.host_filled > b:   # host rows of a larger earlier step: back to padding
            rows[0:2, b:self.host_filled] = 0
            rows[2, b:self.host_filled] = self.scratch_slot
            rows[3, b:self.host_filled] = 1
            rows[4, b:self.host_filled] = -1
            spans[b:self.host_filled] = self.scratch_span
            self.row_spans[b:self.host_filled] = [(None, 0)] * (self.host_filled - b)
        self.host_filled = b
        self.per_row[:, :size].copy_(self.host_rows[:, :size], non_blocking=True)
        self.spans[:size].copy_(self.host_spans[:size], non_blocking=True)
        if device_ids is not None:
            self.ids[:b].copy_(device_ids)
        self.copied.record()
        graphs, outputs = ((self.verify_graphs, self.verify_logits) if verifies else
                           (self.lora_graphs, self.lora_logits) if lora else (self.graphs, self.logits))
        graphs[size].replay()
        logits = outputs[size]
        return None if logits is None else logits[:b]
