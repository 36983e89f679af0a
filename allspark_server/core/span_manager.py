"""SpanManager: allocation and reference counting of KV-cache spans (pages of `span_size` tokens).

Owns only integers: which span ids are free and how many requests hold each span. With a prefix cache
(core/prefix_cache.py), a cached span that loses its last holder is parked in the cache instead of going back
to the free list; `share` gives it a holder again (a prefix hit) and `allocate` evicts parked spans, least
recently used first, when the free list runs short. Parked spans count as available. It does not own the
tensors (step/kv_cache.py) nor decide who gets spans (core/scheduler.py).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

from allspark_server.core.prefix_cache import PrefixCache


class SpanManager:
    def __init__(self, num_spans: int, span_size: int, cache: Optional[PrefixCache] = None):
        if num_spans < 1:
            raise ValueError(f"num_spans must be >= 1, got {num_spans}")
        self.num_spans = num_spans
        self.span_size = span_size
        self.cache = cache
        self._free: deque[int] = deque(range(num_spans))
        self._ref_counts = [0] * num_spans

    @property
    def num_free_spans(self) -> int:
        """Spans an allocation can take now: free ones and cached ones nobody holds."""
        return len(self._free) + self.num_cached_idle

    @property
    def num_cached_idle(self) -> int:
        return self.cache.num_idle if self.cache is not None else 0

    @property
    def num_used_spans(self) -> int:
        """Spans held by at least one request."""
        return self.num_spans - self.num_free_spans

    def spans_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.span_size)

    def can_allocate(self, num_spans: int) -> bool:
        return num_spans <= self.num_free_spans

    def allocate(self, num_spans: int) -> list[int]:
        if not self.can_allocate(num_spans):
            raise RuntimeError(f"asked for {num_spans} spans, {self.num_free_spans} available")
        out = [self._free.popleft() if self._free else self.cache.evict() for _ in range(num_spans)]
        for s in out:
            self._ref_counts[s] = 1
        return out

    def share(self, span_ids: Iterable[int]) -> None:
        """One more holder for each span: held spans, or cached idle ones (a prefix hit takes them back)."""
        for s in span_ids:
            if self._ref_counts[s] == 0:
                if self.cache is None or not self.cache.is_idle(s):
                    raise RuntimeError(f"span {s} is neither held nor cached")
                self.cache.unpark(s)
            self._ref_counts[s] += 1

    def free(self, span_ids: Iterable[int]) -> None:
        """Drop one reference from each span; spans nobody holds are parked in the cache (when it holds a prefix
        in them) or go back to the free list."""
        for s in span_ids:
            if self._ref_counts[s] <= 0:
                raise RuntimeError(f"span {s} freed twice")
            self._ref_counts[s] -= 1
            if self._ref_counts[s] == 0:
                if self.cache is not None and self.cache.holds(s):
                    self.cache.park(s)
                else:
                    self._free.append(s)

    def expire_cached(self) -> None:
        """Cached spans idle longer than the cache's TTL go back to the free list."""
        if self.cache is not None:
            self._free.extend(self.cache.expire())

    def forget_cached(self) -> None:
        """The KV cache's content is gone (the model slept, no request holds a span): cached prefixes back to free."""
        if self.cache is not None:
            self._free.extend(self.cache.forget_spans())

    def ref_count(self, span_id: int) -> int:
        return self._ref_counts[span_id]
