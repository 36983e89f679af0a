"""Tensor-parallel sharding: how each tensor is split across ranks and which slice a rank reads.

COLUMN splits dim 0 (output features) evenly and ROW dim 1 (input features); HEADS splits dim 0 by this
rank's query heads and ROW_HEADS dim 1 by them (o_proj's input); KV_HEADS splits dim 0 by KV head and, when
there are fewer KV heads than ranks, gives each rank a copy of the head its query heads use; VOCAB splits dim
0 in near-even chunks; REPLICATE keeps it whole.

Heads are dealt out by KV group (a KV head and the query heads that read it stay on one rank), in contiguous
near-even runs: a model whose head counts the ranks do not divide still splits (SmolLM2-135M's 9 query and 3
KV heads on 2 ranks: 3 + 6 query heads, 1 + 2 KV heads); the MLP and the vocabulary split as before.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class SplitMode(enum.IntEnum):
    REPLICATE = 0
    COLUMN = 1
    ROW = 2
    HEADS = 3
    KV_HEADS = 4
    VOCAB = 5
    ROW_HEADS = 6


class ShardingError(ValueError):
    pass


@dataclass(frozen=True)
class TPLayout:
    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def for_model(cls, args, rank: int = 0, world_size: int = 1) -> "TPLayout":
        """The layout of a ModelArgs on `world_size` ranks, seen from `rank`."""
        return cls(rank, world_size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size,
                   args.vocab_size)

    def __post_init__(self):
        w = self.world_size
        if self.num_heads % self.num_kv_heads:
            raise ShardingError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                                f"{self.num_kv_heads}")
        if self.num_kv_heads < w and w % self.num_kv_heads:
            raise ShardingError(f"{w} ranks is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.num_kv_heads < w and self.num_heads % w:
            raise ShardingError(f"num_attention_heads {self.num_heads} is not divisible by {w} ranks (with "
                                f"{self.num_kv_heads} KV heads, each rank holds a copy of one)")
        if self.intermediate_size % w:
            raise ShardingError(f"intermediate_size {self.intermediate_size} is not divisible by {w} ranks")

    def head_range(self) -> tuple[int, int]:
        """This rank's query heads [lo, hi)."""
        if self.num_kv_heads < self.world_size:
            per = self.num_heads // self.world_size
            return self.rank * per, (self.rank + 1) * per
        group = self.num_heads // self.num_kv_heads
        lo, hi = self.kv_head_range()
        return lo * group, hi * group

    @property
    def local_heads(self) -> int:
        lo, hi = self.head_range()
        return hi - lo

    @property
    def local_kv_heads(self) -> int:
        lo, hi = self.kv_head_range()
        return hi - lo

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    def vocab_range(self) -> tuple[int, int]:
        per = -(-self.vocab_size // self.world_size)
        lo = min(self.rank * per, self.vocab_size)
        return lo, min(lo + per, self.vocab_size)

    @property
    def local_vocab(self) -> int:
        lo, hi = self.vocab_range()
        return hi - lo

    def kv_head_range(self) -> tuple[int, int]:
        if self.num_kv_heads >= self.world_size:   # contiguous near-even runs
            kv, w = self.num_kv_heads, self.world_size
            return self.rank * kv // w, (self.rank + 1) * kv // w
        head = self.rank * self.num_kv_heads // self.world_size   # replicated: the head my q heads use
        return head, head + 1

    def slice_for(self, mode: SplitMode, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(dim, start, stop) of this rank's slice of a tensor of `shape` (dim -1 = whole)."""
        if mode == SplitMode.REPLICATE or self.world_size == 1:
            return -1, 0, 0
        if mode == SplitMode.VOCAB:
            lo, hi = self.vocab_range()
            return 0, lo, hi
        if mode == SplitMode.KV_HEADS:
            lo, hi = self.kv_head_range()
            return 0, lo * self.head_dim, hi * self.head_dim
        if mode in (SplitMode.HEADS, SplitMode.ROW_HEADS):
            # the rows (or columns) of this rank's heads; a quantized weight's packed codes and groups along K
            # split in proportion, so the heads' boundaries must fall on a byte and a group
            dim, (lo, hi) = int(mode == SplitMode.ROW_HEADS), self.head_range()
            size, full = shape[dim], self.num_heads * self.head_dim
            if (lo * self.head_dim * size) % full or (hi * self.head_dim * size) % full:
                raise ShardingError(f"dim {dim} of size {size} cannot be cut at heads {lo}..{hi} of "
                                    f"{self.num_heads} (a quantization group or packed byte would be split)")
            return dim, lo * self.head_dim * size // full, hi * self.head_dim * size // full
        dim = 1 if mode == SplitMode.ROW else 0
        size = shape[dim]
        if size % self.world_size:
            raise ShardingError(f"dim {dim} of size {size} is not divisible by {self.world_size} ranks")
        per = size // self.world_size
        return dim, self.rank * per, (self.rank + 1) * per


def split_mode_for(name: str, rules: list[tuple[str, SplitMode]]) -> SplitMode:
    for pattern, mode in rules:
        if re.search(pattern, name):
            return mode
    return SplitMode.REPLICATE
