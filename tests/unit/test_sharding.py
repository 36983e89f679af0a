"""TPLayout's split of heads, worked by hand: the slices each rank reads, even and uneven."""
from __future__ import annotations

import pytest

from allspark_server.layers.sharding import ShardingError, SplitMode, TPLayout


def layouts(heads, kv, world, head_dim=64, inter=1536, vocab=100):
    return [TPLayout(r, world, heads, kv, head_dim, inter, vocab) for r in range(world)]


def test_smollm2_shape_on_two_ranks():
    """9 query heads in 3 KV groups of 3: rank 0 holds KV head 0 (query heads 0-2), rank 1 KV heads 1-2
    (query heads 3-8); q rows, o_proj columns and k/v rows follow, the MLP halves."""
    r0, r1 = layouts(9, 3, 2)
    assert (r0.head_range(), r1.head_range()) == ((0, 3), (3, 9))
    assert (r0.kv_head_range(), r1.kv_head_range()) == ((0, 1), (1, 3))
    assert (r0.local_heads, r1.local_heads, r0.local_kv_heads, r1.local_kv_heads) == (3, 6, 1, 2)
    assert r1.slice_for(SplitMode.HEADS, (576, 576)) == (0, 192, 576)
    assert r1.slice_for(SplitMode.ROW_HEADS, (576, 576)) == (1, 192, 576)
    assert r0.slice_for(SplitMode.KV_HEADS, (192, 576)) == (0, 0, 64)
    assert r1.slice_for(SplitMode.ROW, (576, 1536)) == (1, 768, 1536)
    # o_proj quantized in groups of 32: packed 4-bit codes [576, 288] and group scales [576, 18] split like K
    assert r1.slice_for(SplitMode.ROW_HEADS, (576, 288)) == (1, 96, 288)
    assert r1.slice_for(SplitMode.ROW_HEADS, (576, 18)) == (1, 6, 18)
    with pytest.raises(ShardingError, match="cannot be cut at heads 3..9 of 9"):
        r1.slice_for(SplitMode.ROW_HEADS, (576, 4))          # groups of 144 would be split at K = 192


def test_even_splits_are_what_they_were():
    """8 heads in 4 KV groups on 2 ranks: halves, as before the uneven split existed; 1 KV head on 2 ranks:
    each rank a copy of it and half the query heads."""
    r0, r1 = layouts(8, 4, 2)
    assert (r0.head_range(), r1.head_range(), r1.kv_head_range()) == ((0, 4), (4, 8), (2, 4))
    m0, m1 = layouts(8, 1, 2)
    assert (m0.head_range(), m1.head_range(), m0.kv_head_range(), m1.kv_head_range()) == ((0, 4), (4, 8),
                                                                                          (0, 1), (0, 1))


@pytest.mark.parametrize("heads,kv,world,message", [
    (3, 1, 2, "num_attention_heads 3 is not divisible by 2 ranks"),
    (4, 3, 2, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (8, 2, 4, None), (8, 2, 3, "3 ranks is not a multiple of num_key_value_heads 2"),
])
def test_splits_that_cannot_be_made_name_the_reason(heads, kv, world, message):
    if message is None:
        assert sum(t.local_heads for t in layouts(heads, kv, world)) == heads
        return
    with pytest.raises(ShardingError, match=message):
        layouts(heads, kv, world)
