"""Prompt lookup ("ngram" speculation): the tokens that followed the latest earlier occurrence of the request's
last n tokens, for n from prompt_lookup_max down to prompt_lookup_min. No model: a rewrite, a code edit or an
answer quoting its context repeats long runs of the prompt, and those runs are proposed for free.

A request's NgramIndex maps every n-gram of its tokens to where it starts, and grows with the tokens the request
accepts (only ever appended), so that a step's lookup costs a few dictionary reads whatever the context's length:
on a GPU the lookup sits between a verify step's tokens and the next launch, where the GPU waits for the host."""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max) of one token sequence starts, kept up to date as it grows: per n, the
    latest start of each n-gram (keyed by its tokens packed into one int) and, for every start, the n-gram's start
    before it, a chain back through its occurrences. Ints only: no per-n-gram containers for the cyclic GC to walk
    (a 32k-token prompt indexes in tens of milliseconds)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self._latest: list[dict[int, int]] = [{} for _ in range(self.n_max + 1)]   # [n]: n-gram -> its latest start
        self._before: list[list[int]] = [[] for _ in range(self.n_max + 1)]        # [n][p]: start before p's, or -1

    def extend(self, new: Sequence[int]) -> None:
        """Index the tokens that follow the indexed ones."""
        if not new:
            return
        self.tokens.extend(new)
        ids, total = self.tokens, len(self.tokens)
        for n in range(self.n_min, self.n_max + 1):
            latest, before = self._latest[n], self._before[n]
            for p in range(len(before), total - n + 1):
                key = 0
                for t in ids[p:p + n]:
                    key = (key << 32) | t
                before.append(latest.get(key, -1))
                latest[key] = p

    def follow(self, request) -> None:
        """Index what a request (core/request.py) has added since the last call: its tokens are only ever appended,
        so only the new ones are read (a check that its last indexed token is still there, else all anew)."""
        have = len(self.tokens)
        if have and request.num_tokens >= have:
            tail = request.token_ids_from(have - 1)
            if tail[0] == self.tokens[-1]:
                self.extend(tail[1:])
                return
        self._clear()
        self.extend(request.all_token_ids)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens to follow the sequence: for the longest n whose last-n suffix occurs earlier, the k
        tokens after its latest earlier occurrence that has k tokens after it, else after its latest (fewer, cut
        where the sequence ends). [] when no suffix occurs earlier."""
        ids = self.tokens
        total = len(ids)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            before = self._before[n]
            p = before[total - n]          # the suffix's latest earlier start: it ends before the last token
            if p < 0:
                continue
            latest = p
            while p >= 0 and p + n + k > total:
                p = before[p]
            start = (p if p >= 0 else latest) + n
            return ids[start:start + k]
        return []


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """NgramIndex's proposal for `tokens` alone (a fresh index)."""
    index = NgramIndex(n_min, n_max)
    index.extend(list(tokens))
    return index.propose(k)
