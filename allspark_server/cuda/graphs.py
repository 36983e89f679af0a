"""CUDA graphs for decode-only steps on a GPU rank.

At install, one decode step is captured per batch size of a ladder (1, 2, 4, 8, ... up to max_batch), all
reading the same static input buffers and sharing one memory pool (largest captured first). A decode-only
step of B sequences copies its inputs into the first rows of those buffers, pads them up to the next size
of the ladder and replays that graph: a whole step is one launch from the host instead of one per kernel.
Padding rows decode token 0 at position 0 into a scratch span that no request owns (the cache holds one
span more than the span manager hands out), so they can never touch a request's keys and values.
Steps with a prefill chunk run eagerly.
"""
from __future__ import annotations

import torch

from allspark_server.runner.forward_inputs import AttentionMetadata, ForwardInputs


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... doubling, and max_batch itself last."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_spans_per_seq: int, scratch_span: int,
                 span_size: int, device: torch.device):
        self.model, self.kv = model, kv_cache
        self.sizes = batch_ladder(max_batch)
        self.scratch_span, self.scratch_slot = scratch_span, scratch_span * span_size
        long = dict(dtype=torch.long, device=device)
        # ids, positions, slots and context lengths in one tensor, so a step's inputs arrive in two copies
        self.per_row = torch.zeros(4, max_batch, **long)                                 # [4, Bmax]
        self.ids, self.positions, self.slots, self.ctx = self.per_row
        self.spans = torch.full((max_batch, max_spans_per_seq), scratch_span, **long)   # [Bmax, MAXS]
        self._pad(0, max_batch)
        self.filled = 0   # rows holding the last step's sequences
        self.rows = torch.arange(max_batch, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _inputs(self, b: int) -> ForwardInputs:
        meta = AttentionMetadata(self.slots[:b], [], self.rows[:b], self.spans[:b], self.ctx[:b])
        return ForwardInputs(self.ids[:b], self.positions[:b], meta, self.rows[:b], [])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        for b in sorted(self.sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):      # warm-up outside the graph: Triton compiles, cuBLAS picks
                for _ in range(2):
                    self.model(self._inputs(b), self.kv)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self.model(self._inputs(b), self.kv)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _pad(self, begin: int, end: int) -> None:
        """Rows [begin, end) decode token 0 at position 0 into the scratch span."""
        self.ids[begin:end].zero_()
        self.positions[begin:end].zero_()
        self.slots[begin:end].fill_(self.scratch_slot)
        self.ctx[begin:end].fill_(1)
        self.spans[begin:end].fill_(self.scratch_span)

    def fits(self, inputs: ForwardInputs) -> bool:
        """A decode-only step (one token per sequence, every row sampled) of at most max_batch sequences whose
        span tables fit the static buffer."""
        b = inputs.input_ids.shape[0]
        return (not inputs.attn.seqs and b <= self.sizes[-1] and inputs.sample_rows.shape[0] == b
                and inputs.attn.decode_spans.shape[1] <= self.spans.shape[1])

    def run(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """The step's fp32 logits [B, V] (a view of the graph's output: read it before the next step). `inputs`
        may be on the host: they are copied into the static buffers directly."""
        b = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        meta = inputs.attn
        self.per_row[:, :b].copy_(torch.stack([inputs.input_ids, inputs.positions, meta.slot_mapping,
                                                meta.decode_ctx]))
        self.spans[:b, :meta.decode_spans.shape[1]].copy_(meta.decode_spans)
        if self.filled > b:   # rows of a larger earlier step: back to padding
            self._pad(b, self.filled)
        self.filled = b
        self.graphs[size].replay()
        logits = self.logits[size]   # None on the ranks other than 0 of a pool (the LM head gathers to rank 0)
        return None if logits is None else logits[:b]
