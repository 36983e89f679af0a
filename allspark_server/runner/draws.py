"""The draw: how the sampler takes a token from each sampled row's processed logits (temperature, top_k and top_p
applied). The sampler picks one of the two once per model, with the device (sampler.py).

`multinomial_draws` (the host's): each row's softmax goes to torch.multinomial with the request's own seeded
torch.Generator, so a seed gives the stream of tokens torch's generator gives it.

`gumbel_draws` (a GPU's): a torch.Generator per row cannot be vectorized, so the draws are counter-based. Token i of
a request's n-th draw (n = len(output_ids)) gets a uniform u from an integer hash of (seed, n, i), 32-bit mixing in
int64 torch ops that never overflow, and the row takes argmax(logit_i / T + Gumbel(u_i)) over the tokens top_k /
top_p keep (Gumbel-max: an exact draw from their softmax). A draw depends on the request alone, never on its batch,
and repeats with the seed; it is not the host generator's stream, so CPU and GPU logits give a seed different
tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from allspark_server.runner.sample_types import Row

# (processed logits [D, V] of the rows drawn, those rows) -> their tokens [D] (long, on the logits' device)
Draw = Callable[[torch.Tensor, list[Row]], torch.Tensor]
_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


def multinomial_draws(xs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """One torch.multinomial per row, each with its request's generator (a generator serves one row at a time)."""
    probs = torch.softmax(xs, -1)
    return torch.cat([torch.multinomial(probs[j], 1, generator=state.generator)
                      for j, (state, _, _) in enumerate(rows)])


def gumbel_draws(xs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Every row at once: argmax of the logits plus each request's counter-based Gumbel noise."""
    keys = [draw_key(state.seed, len(output_ids)) for state, _, output_ids in rows]
    return (xs + gumbel_noise(keys, xs.shape[-1], xs.device)).argmax(-1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_key(seed: int, step: int) -> int:
    """The 64-bit key of a request's `step`-th draw (host side, Python ints)."""
    return _splitmix64(_splitmix64(seed & _M64) ^ step)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for 0 <= x < 2^32 in int64 with no overflow (16-bit halves of c: products < 2^49)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash (C. Wellons) of 32-bit values held in int64: a bijection of [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: Sequence[int], vocab: int, device) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(keys), vocab] (fp32), entry (r, i) a function of keys[r] and i only."""
    k = torch.tensor([[key & _M32, key >> 32] for key in keys], dtype=torch.long).to(device, non_blocking=True)
    tokens = torch.arange(vocab, dtype=torch.long, device=device)                  # [V]
    h = mix32(mix32(tokens ^ k[:, :1]) ^ k[:, 1:])                                  # [R, V] in [0, 2^32)
    u = ((h >> 8).double() + 0.5) * 2.0 ** -24                                      # 24 bits: (0, 1), exact in fp64
    return torch.log1p(-u).neg_().log_().neg_().float()                             # -log(-log(1 - u)), finite
