"""Prompt lookup (speculative/ngram.py): hand-worked proposals, and the index grown token by token proposing what a
brute-force scan of the whole sequence finds, on random sequences over small vocabularies (many repeats)."""
from __future__ import annotations

import random

import pytest

from allspark_server.speculative.ngram import NgramIndex, propose_ngram
from allspark_server.speculative.speculation import NgramProposer


def scan(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The rule written out plainly: longest suffix first, its latest earlier occurrence with k tokens after it,
    else its latest earlier occurrence."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        earlier = [p for p in range(total - n) if tokens[p:p + n] == suffix]
        if earlier:
            full = [p for p in earlier if p + n + k <= total]
            start = (full[-1] if full else earlier[-1]) + n
            return tokens[start:start + k]
    return []


@pytest.mark.parametrize("tokens, k, n_min, n_max, want", [
    # "7 8" occurs at 0 and 4; the latest earlier one (4) has 3 tokens after it
    ([7, 8, 1, 2, 7, 8, 3, 4, 9, 7, 8], 3, 1, 2, [3, 4, 9]),
    # with k = 6 only the occurrence at 0 has 6 tokens after it
    ([7, 8, 1, 2, 7, 8, 3, 4, 9, 7, 8], 6, 1, 2, [1, 2, 7, 8, 3, 4]),
    # the 3-gram "1 2 3" occurs once before: the longest n wins over the later 1-gram "3"
    ([1, 2, 3, 5, 6, 3, 9, 1, 2, 3], 2, 1, 3, [5, 6]),
    # n_min 2: the last 2 tokens "9 3" never occurred before; "3" alone is not looked up
    ([1, 2, 3, 5, 6, 3, 9, 3], 2, 2, 3, []),
    # ... with n_min 1 the latest earlier "3" (at 5) is followed by "9 3"
    ([1, 2, 3, 5, 6, 3, 9, 3], 2, 1, 3, [9, 3]),
    # a run of one token: the occurrence overlapping the suffix counts, cut where the sequence ends
    ([4, 4, 4], 2, 1, 2, [4]),
    ([4, 4, 4, 4], 1, 1, 2, [4]),
    ([4, 4], 3, 1, 2, [4]),
    ([5], 3, 1, 2, []),
    ([], 3, 1, 2, []),
])
def test_hand_worked_proposals(tokens, k, n_min, n_max, want):
    assert propose_ngram(tokens, k, n_min, n_max) == want == scan(tokens, k, n_min, n_max)


@pytest.mark.parametrize("vocab, n_min, n_max, k", [(3, 1, 3, 4), (5, 2, 4, 4), (8, 1, 1, 8), (2, 2, 5, 3)])
def test_growing_index_proposes_what_a_scan_finds(vocab, n_min, n_max, k):
    rng = random.Random(vocab * 100 + n_max)
    index = NgramIndex(n_min, n_max)
    tokens: list[int] = []
    proposed = 0
    while len(tokens) < 300:
        step = [rng.randrange(vocab) for _ in range(rng.randint(1, k + 1))]      # a step's accepted tokens
        tokens += step
        index.extend(step)
        got = index.propose(k)
        assert got == scan(tokens, k, n_min, n_max), len(tokens)
        proposed += bool(got)
    assert proposed > 50


class Req:
    """What NgramProposer reads of core/request.py's Request."""

    def __init__(self, rid, ids):
        self.request_id, self.all_token_ids, self.num_tokens = rid, ids, len(ids)
        self.read_from = None

    def token_ids_from(self, start):
        self.read_from = start
        return self.all_token_ids[start:]


def test_a_request_whose_tokens_do_not_continue_the_index_is_indexed_anew():
    index = NgramIndex(1, 2)
    index.follow(Req(1, [1, 2, 3, 1, 2]))
    assert index.propose(2) == [3, 1]
    index.follow(Req(1, [5, 6, 5]))            # shorter: a new sequence
    assert index.propose(2) == [6, 5]
    index.follow(Req(1, [5, 6, 9, 7, 6]))      # longer, but its last indexed token differs
    assert index.tokens == [5, 6, 9, 7, 6] and index.propose(2) == scan([5, 6, 9, 7, 6], 2, 1, 2) == [9, 7]


def test_proposer_keeps_an_index_per_request_until_forgotten():
    proposer = NgramProposer(1, 2)
    a, b = Req(1, [1, 2, 3, 1, 2]), Req(2, [4, 5, 4])
    assert proposer.propose([a, b], [2, 3]) == [[3, 1], [5, 4]]
    a = Req(1, a.all_token_ids + [3, 1])
    assert proposer.propose([a], [2]) == [scan(a.all_token_ids, 2, 1, 2)]
    assert a.read_from == 4                    # only the new tokens, and the last one indexed, were read
    proposer.forget(1)
    assert set(proposer._index) == {2}
    proposer.close()
    assert not proposer._index
