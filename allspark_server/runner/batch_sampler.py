"""Sampling a step's rows together on their device (the sampler's path for GPU logits; any device works).

`sample_batch` is `Sampler.sample_row`'s chain vectorized over the rows: raw log-softmax for rows with
logprobs, repetition / presence / frequency penalties from one flat index of the rows' token ids, min_length
EOS mask, then greedy argmax, or temperature -> top_k -> top_p (one sort) -> a draw. Only the token ids and the
requested logprobs leave the device, in one asynchronous transfer (`sample_batch_start` returns at once; the
sampled ids also stay on the device). It does not apply guided masks (the caller has).

Draws are counter-based rather than a torch.Generator per row (which cannot be vectorized): token i of a
request's n-th draw (n = len(output_ids)) gets a uniform u from an integer hash of (seed, n, i), 32-bit mixing
in int64 torch ops that never overflow, and the row takes argmax(logit_i / T + Gumbel(u_i)) over the tokens
top_k / top_p keep (Gumbel-max: an exact draw from their softmax). A draw depends on the request alone, never
on its batch, and repeats with the seed; it is not the host generator's stream, so CPU and GPU logits give a
seed different tokens.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch

from allspark_server.runner.sample_types import PendingSample, SampleResult, SamplingState, suppresses_eos

Row = tuple[SamplingState, list[int], list[int]]   # (state, all_ids = prompt + output, output_ids)
_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


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


def mask_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Per row r of x [R, V]: mask_top_p(mask_top_k(x[r], top_k[r]), top_p[r]) from one ascending sort
    (top_k [R] long, 0 or >= V: off; top_p: floats, 1.0: off). Of tied tokens at the top_p cut the lower ids
    stay (mask_top_p's unstable sort leaves that open)."""
    v = x.shape[-1]
    s, order = torch.sort(x, dim=-1, descending=True, stable=True)
    s, order = s.flip(-1), order.flip(-1)                          # [R, V] ascending, ties: the higher id first
    k_on = ((top_k > 0) & (top_k < v))[:, None]
    kth = s.gather(1, (v - top_k.clamp(1, v))[:, None])                             # [R, 1] k-th largest
    remove = k_on & (s < kth)
    s = s.masked_fill(remove, float("-inf"))
    # (1 - p) in float64 then in x's dtype, exactly as mask_top_p's python-scalar comparison
    below = torch.tensor([1.0 - p for p in top_p], dtype=x.dtype).to(x.device, non_blocking=True)[:, None]
    p_on = torch.tensor([p < 1.0 for p in top_p]).to(x.device, non_blocking=True)[:, None]
    remove |= p_on & (s.softmax(-1).cumsum(-1) <= below)
    remove[:, -1] = False                                                           # the most likely stays
    return x.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def _on(device, values: list, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _flat_index(id_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """Positions row * vocab + id of every id of row j (id_lists[j]) in a flattened [R, vocab]."""
    lens = [len(ids) for ids in id_lists]
    ids = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), torch.tensor(lens, dtype=torch.long))
    return (rows * vocab + ids).to(device, non_blocking=True)


def apply_penalties_rows(x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """`sampler.apply_penalties` on every row of x [R, V] (row j with rows[j]), elementwise the same math."""
    r, v = x.shape
    gens = [st.gen for st, _, _ in rows]
    seen_ids = [a if g.repetition_penalty != 1.0 else [] for g, (_, a, _) in zip(gens, rows)]
    if any(seen_ids):
        seen = torch.zeros(r * v, dtype=torch.bool, device=x.device)
        seen[_flat_index(seen_ids, v, x.device)] = True
        pen = _on(x.device, [g.repetition_penalty for g in gens], x.dtype)[:, None]     # [R, 1]
        x = torch.where(seen.view(r, v), torch.where(x < 0, x * pen, x / pen), x)
    out = [o if (g.presence_penalty or g.frequency_penalty) else [] for g, (_, _, o) in zip(gens, rows)]
    if any(out):
        counts = torch.zeros(r * v, dtype=x.dtype, device=x.device)
        flat = _flat_index(out, v, x.device)
        counts.index_put_((flat,), torch.ones(flat.shape, dtype=x.dtype, device=x.device), accumulate=True)
        counts = counts.view(r, v)
        freq = _on(x.device, [g.frequency_penalty for g in gens], x.dtype)[:, None]
        pres = _on(x.device, [g.presence_penalty for g in gens], x.dtype)[:, None]
        x = x - (freq * counts + pres * (counts > 0).to(x.dtype))
    return x


def sample_batch(logits: torch.Tensor, rows: list[Row]) -> list[SampleResult]:
    """Every row of logits [N, V] (guided masks already applied) with its (state, all_ids, output_ids); the
    same results as `Sampler.sample_row` on each row, apart from the draws (see the module docstring)."""
    return sample_batch_start(logits, rows).results()


@torch.inference_mode()
def sample_batch_start(logits: torch.Tensor, rows: list[Row]) -> PendingSample:
    """sample_batch's work queued on the device: the tokens [N] there, the results when the host asks."""
    n, v = logits.shape
    dev = logits.device
    gens = [st.gen for st, _, _ in rows]

    def idx(ids: list[int]) -> torch.Tensor:
        return _on(dev, ids, torch.long)
    x = logits
    pen = [i for i, g in enumerate(gens) if g.has_penalties]
    if pen:
        x, p = x.clone(), idx(pen)
        x[p] = apply_penalties_rows(x[p], [rows[i] for i in pen])
    eos = [(i, t) for i, (st, a, _) in enumerate(rows) if suppresses_eos(st.gen, len(a))
           for t in st.gen.eos_token_ids]
    if eos:
        x = x.clone() if not pen else x
        x[idx([i for i, _ in eos]), idx([t for _, t in eos])] = float("-inf")
    draw = [i for i, g in enumerate(gens) if not g.is_greedy]
    if not draw:
        tokens = x.argmax(-1)                                                       # [N]
    else:
        tokens = torch.empty(n, dtype=torch.long, device=dev)
        greedy = [i for i, g in enumerate(gens) if g.is_greedy]
        if greedy:
            g = idx(greedy)
            tokens[g] = x[g].argmax(-1)
        d = idx(draw)
        xs = x[d] / _on(dev, [gens[i].temperature for i in draw], x.dtype)[:, None]  # [D, V]
        if any(0 < gens[i].top_k < v or gens[i].top_p < 1.0 for i in draw):
            xs = mask_top_k_top_p(xs, _on(dev, [min(gens[i].top_k, v) for i in draw], torch.long),
                                  [gens[i].top_p for i in draw])
        keys = [draw_key(rows[i][0].seed, len(rows[i][2])) for i in draw]
        tokens[d] = (xs + gumbel_noise(keys, v, dev)).argmax(-1)
    parts = [tokens.double()]
    lp = [i for i, g in enumerate(gens) if g.logprobs]
    top_n = max((gens[i].top_logprobs for i in lp), default=0)
    if lp:
        rows_lp = idx(lp)
        raw = torch.log_softmax(logits[rows_lp], -1)                                # [L, V] of the raw logits
        parts.append(raw.gather(1, tokens[rows_lp][:, None]).double().flatten())
        if top_n:
            top = torch.topk(raw, top_n)                                            # [L, top_n]
            parts += [top.values.double().flatten(), top.indices.double().flatten()]
    lp_gens = [(i, gens[i].top_logprobs) for i in lp]
    return PendingSample(tokens, torch.cat(parts), lambda host: _results(host, n, lp_gens, top_n))


def _results(host: list[float], n: int, lp_gens: list[tuple[int, int]], top_n: int) -> list[SampleResult]:
    """Unpack sample_batch_start's one transfer: n ids, then per logprobs row its logprob, then the top values
    and ids (top_n per row); lp_gens: (row, its top_logprobs) of the rows with logprobs."""
    results = [SampleResult(int(t)) for t in host[:n]]
    nl = len(lp_gens)
    values, ids = host[n + nl:n + nl * (1 + top_n)], host[n + nl * (1 + top_n):]
    for j, (i, k) in enumerate(lp_gens):
        results[i].logprob = host[n + j]
        results[i].top_logprobs = [(int(t), val) for t, val in zip(ids[j * top_n:j * top_n + k],
                                                                   values[j * top_n:j * top_n + k])]
    return results
