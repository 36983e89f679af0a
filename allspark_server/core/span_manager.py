"""SpanManager: allocation and reference counting of KV-cache spans (pages of `span_size` tokens).

Owns only integers: which span ids are free and how many holders each used span has (ref counts
let a later prefix cache share spans between requests). It does not own the tensors (runner/kv_cache.py)
nor decide who gets spans (core/scheduler.py).
"""
from __future__ import annotations

from collections import deque


class SpanManager:
    def __init__(self, num_spans: int, span_size: int):
        if num_spans < 1:
            raise ValueError(f"num_spans must be >= 1, got {num_spans}")
        self.num_spans = num_spans
        self.span_size = span_size
        self._free: deque[int] = deque(range(num_spans))
        self._ref_counts = [0] * num_spans

    @property
    def num_free_spans(self) -> int:
        return len(self._free)

    @property
    def num_used_spans(self) -> int:
        return self.num_spans - len(self._free)

    def spans_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.span_size)

    def can_allocate(self, num_spans: int) -> bool:
        return num_spans <= len(self._free)

    def allocate(self, num_spans: int) -> list[int]:
        if not self.can_allocate(num_spans):
            raise RuntimeError(f"asked for {num_spans} spans, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(num_spans)]
        for s in out:
            self._ref_counts[s] = 1
        return out

    def add_ref(self, span_ids: list[int]) -> None:
        for s in span_ids:
            if self._ref_counts[s] <= 0:
                raise RuntimeError(f"span {s} is not allocated")
            self._ref_counts[s] += 1

    def free(self, span_ids: list[int]) -> None:
        """Drop one reference from each span; spans nobody holds go back to the free list."""
        for s in span_ids:
            if self._ref_counts[s] <= 0:
                raise RuntimeError(f"span {s} freed twice")
            self._ref_counts[s] -= 1
            if self._ref_counts[s] == 0:
                self._free.append(s)

    def ref_count(self, span_id: int) -> int:
        return self._ref_counts[span_id]
