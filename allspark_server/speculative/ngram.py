"""Prompt lookup ("ngram" speculation): the tokens that followed the latest earlier occurrence of the request's
last n tokens, for n from prompt_lookup_max down to prompt_lookup_min. No model: a rewrite, a code edit or an
answer quoting its context repeats long runs of the prompt, and those runs are proposed for free."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: "list[int] | np.ndarray", k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens proposed to follow `tokens`: for the longest n in [n_min, n_max] whose last-n suffix occurs
    earlier in `tokens`, the k tokens that followed its latest earlier occurrence followed by k tokens (else by fewer:
    the latest one's, cut where `tokens` ends). [] when none."""
    ids = np.asarray(tokens, dtype=np.int64)
    total = ids.shape[0]
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = ids[total - n:]
        # windows starting at 0 .. total-n-1: every occurrence before the suffix itself
        windows = sliding_window_view(ids[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # the token after the latest earlier occurrence that is followed by k tokens, else after the latest
            full = hits[hits + n + k <= total]
            start = int(full[-1] if full.size else hits[-1]) + n
            return ids[start:start + k].tolist()
    return []
