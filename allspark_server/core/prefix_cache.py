"""PrefixCache: rank 0's index of full KV spans by the token prefix they complete (DashInfer's prefill cache).

A full span is keyed by a hash chained over the token ids of every span before it and its own, seeded with what else
shapes its content (the model file, the dtype, the KV mode, and the request's LoRA adapter, if any). A new request
looks up the keys of its prompt's full spans in order and reuses the longest run that is cached; only the rest is
prefilled.

The cache owns no memory and no reference counts: SpanManager hands it spans that no request holds any more
(`park`), takes them back when a request shares them again (`unpark`) or when it needs free spans (`evict`,
least recently used first). Idle spans older than the TTL are dropped lazily (`expire`). Workers of a pool know
nothing of it: a hit is a request that arrives with spans and computed tokens already set in the StepPlan.

Under it may sit a second tier (`HostTier`: slots of host memory on every rank, indexed here). An evicted span is
copied to a tier slot instead of vanishing, and a later hit copies it back into a fresh span. The copies to make
are collected here (`take_copies`) and travel in the next StepPlan; every rank's runner makes them before the
step's forward pass, saves before loads.
"""
from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Optional

KEY_BYTES = 16


def chain_keys(salt: bytes, token_ids: list[int], span_size: int, num_spans: int,
               known: Optional[list[bytes]] = None) -> list[bytes]:
    """Keys of the first `num_spans` full spans of `token_ids`: key_i = H(key_{i-1} || tokens of span i), key_-1 =
    H(salt). `known` holds keys computed before for the same tokens and is extended in place (and returned)."""
    keys = known if known is not None else []
    prev = keys[-1] if keys else hashlib.blake2b(salt, digest_size=KEY_BYTES).digest()
    for i in range(len(keys), num_spans):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("q", token_ids[i * span_size:(i + 1) * span_size]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


def _longest_run(keys: Iterable[bytes], find: Callable[[bytes], Optional[int]]) -> list[int]:
    """find(key) for the keys from the first, up to the first one it does not find."""
    out = []
    for key in keys:
        found = find(key)
        if found is None:
            break
        out.append(found)
    return out


class HostTier:
    """Rank 0's index of the tier's slots: which prefix key each holds, least recently used first. A slot read
    by this step's loads is pinned (never reused by this step's saves)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots))
        self._pinned: set[int] = set()

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, key: bytes) -> Optional[int]:
        """The slot holding `key` (now the most recently used, pinned for this step), or None."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            self._pinned.add(slot)
        return slot

    def put(self, key: bytes) -> Optional[int]:
        """A slot for `key`: a free one or the least recently used unpinned one; None when all are pinned."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
        self._slot_of[key] = slot
        return slot

    def unpin_all(self) -> None:
        self._pinned.clear()


class PrefixCache:
    def __init__(self, salt: str, span_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 tier: Optional[HostTier] = None):
        self.salt = salt.encode()
        self.tier = tier
        self._saves: list[tuple[int, int]] = []   # (span, slot): copies to the tier this step
        self._loads: list[tuple[int, int]] = []   # (slot, span): copies back
        self.span_size = span_size
        self.ttl_s = ttl_s
        self.clock = clock
        self._span_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, float] = OrderedDict()   # cached spans nobody holds -> when parked; LRU first

    # ---- what the scheduler asks ---------------------------------------------------------------
    def keys(self, token_ids: list[int], num_spans: int, known: Optional[list[bytes]] = None,
             adapter: str = "") -> list[bytes]:
        """adapter: what else shapes this request's K/V (its LoRA adapter's identity; "" for the base model)."""
        salt = self.salt + b"|lora:" + adapter.encode() if adapter else self.salt
        return chain_keys(salt, token_ids, self.span_size, num_spans, known)

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """Spans of the longest cached run of `keys` from the first (the caller takes references on them)."""
        return _longest_run(keys, self._span_of.get)

    def register(self, span: int, key: bytes) -> bool:
        """`span` (held by a request, fully computed) now holds the prefix `key`. A prefix cached already in another
        span keeps that one (False)."""
        if key in self._span_of or span in self._key_of:
            return False
        self._span_of[key] = span
        self._key_of[span] = key
        return True

    # ---- what SpanManager tells it ---------------------------------------------------------------
    def holds(self, span: int) -> bool:
        return span in self._key_of

    def park(self, span: int) -> None:
        """A cached span lost its last holder: it stays cached, reusable by a hit or by the allocator."""
        self._idle[span] = self.clock()

    def unpark(self, span: int) -> None:
        del self._idle[span]

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_idle(self, span: int) -> bool:
        return span in self._idle

    def evict(self) -> int:
        """Forget the least recently used idle span and hand it back for reuse (its content goes to the tier, when
        there is one and it does not hold that prefix yet)."""
        span, _ = self._idle.popitem(last=False)
        key = self._key_of[span]
        if self.tier is not None and key not in self.tier:
            slot = self.tier.put(key)
            if slot is not None:
                self._saves.append((span, slot))
        self._forget(span)
        return span

    # ---- the second tier -------------------------------------------------------------------------
    def tier_run(self, keys: Iterable[bytes]) -> list[int]:
        """Tier slots of the longest run of `keys` (from the first) that the tier holds."""
        return _longest_run(keys, self.tier.get) if self.tier is not None else []

    def load(self, slot: int, span: int, key: bytes) -> None:
        """`span` (just allocated to a request) gets the tier's copy of `key` this step and holds that prefix."""
        self._loads.append((slot, span))
        self.register(span, key)

    def take_copies(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The (saves, loads) collected since the last call, for the next StepPlan."""
        saves, loads = tuple(self._saves), tuple(self._loads)
        self._saves, self._loads = [], []
        if self.tier is not None:
            self.tier.unpin_all()
        return saves, loads

    def expire(self) -> list[int]:
        """Forget idle spans parked longer than the TTL ago; returns them (now free)."""
        out, limit = [], self.clock() - self.ttl_s
        while self._idle:
            span, parked = next(iter(self._idle.items()))
            if parked > limit:
                break
            self._idle.popitem(last=False)
            self._forget(span)
            out.append(span)
        return out

    def forget_spans(self) -> list[int]:
        """Forget every prefix the KV cache's spans hold (their content is gone: the model slept); none may be held
        by a request. Returns the idle spans, now free; the host tier keeps its copies."""
        if len(self._idle) != len(self._key_of):
            raise RuntimeError(f"{len(self._key_of) - len(self._idle)} cached span(s) are still held")
        out = list(self._idle)
        self._idle.clear()
        self._span_of.clear()
        self._key_of.clear()
        return out

    def _forget(self, span: int) -> None:
        del self._span_of[self._key_of.pop(span)]

    @property
    def num_cached(self) -> int:
        return len(self._key_of)
