"""Sampler (rank 0 only): turns the logits rows of a step into their next tokens, on the host or a GPU alike.

Order, per row: the guided-output mask of requests with a response_format (disallowed tokens -inf; their
logprobs are those of the constrained distribution), the request's logit_bias (added: the logprobs include it),
raw logprobs (for the `logprobs` output), repetition penalty over prompt + output, presence and frequency
penalties over the output, min_length (EOS masked), then greedy argmax or temperature -> top_k -> top_p -> a draw.
The chain runs on all of a step's rows together, on the logits' device: the penalties from one flat index of the
rows' token ids, top_k and top_p from one sort, and only the token ids and the requested logprobs leave the device,
in one transfer. Rows never mix, so a request's tokens do not depend on the rest of its batch.

The device is chosen once per model, `Sampler(device_kind)`, and with it the little that differs (its kind's
`samples_on_host`, compute/device_kind.py): the draw (draws.py: on the host torch.multinomial with each request's
own seeded generator, on a GPU counter-based Gumbel draws), the argmax of a batch of plain greedy rows (numpy's on
the host), and how results reach the host (the kind's `copy_to_host`): on a GPU `start_rows` only queues the work,
the tokens stay there (the next decode step can read them there) and the host learns them when it asks
(`PendingSample.results`), from a copy queued at once.
"""
from __future__ import annotations

from itertools import chain
from typing import Optional, Sequence

import torch

from allspark_client.generation_config import GenerationConfig
from allspark_server.compute.device_choice import device_kind_of
from allspark_server.compute.device_kind import DeviceKind
from allspark_server.runner.draws import Draw, gumbel_draws, multinomial_draws
from allspark_server.runner.guided import apply_masks
from allspark_server.runner.logit_bias import apply_logit_bias
from allspark_server.runner.sample_types import PendingSample, Row, SampleResult, SamplingState, suppresses_eos

__all__ = ["PendingSample", "SampleResult", "Sampler", "SamplingState", "apply_penalties_rows", "argmax",
           "mask_top_k_top_p", "plain_greedy"]


def plain_greedy(gen: GenerationConfig, num_tokens: int) -> bool:
    """Greedy with no penalties, logprobs or masked EOS at `num_tokens`: the row's token is its logits' argmax.
    True at `num_tokens` means true at every later count too (min_length only stops applying)."""
    return gen.is_greedy and not gen.logprobs and not gen.has_penalties and not suppresses_eos(gen, num_tokens)


def argmax(x: torch.Tensor) -> "int | list[int]":
    """The host's argmax along the last dim: the first index of the largest value (a NaN counts as largest, as in
    torch.argmax), an int for one row, a list for rows. fp32 goes to numpy, far cheaper than torch.argmax on a
    row, which every greedy token pays (docs/performance.md, "Choices in the code")."""
    if x.dtype == torch.float32:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def _on(device, values: list, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _flat_index(id_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """Positions row * vocab + id of every id of row j (id_lists[j]) in a flattened [R, vocab]."""
    lens = [len(ids) for ids in id_lists]
    ids = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), torch.tensor(lens, dtype=torch.long))
    return (rows * vocab + ids).to(device, non_blocking=True)


def apply_penalties_rows(x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The penalties of every row of x [R, V] (row j with rows[j]), a new tensor: the repetition penalty over each
    id of prompt + output once (a logit below 0 times the penalty, else divided by it, as transformers does), then
    logit -= frequency * count + presence * (count > 0) over the output's ids."""
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


def mask_top_k_top_p(x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Per row r of x [R, V]: the tokens below the top_k[r]-th largest logit -inf (ties with it stay; 0 or >= V:
    off), then of the rest all but the smallest set of most likely tokens whose probability reaches top_p[r] (at
    least one; 1.0: off). One sort serves both; top_k alone needs only a topk. Of tokens tied at the top_p cut
    the lower ids stay."""
    v = x.shape[-1]
    k = torch.tensor([kr if 0 < kr < v else 0 for kr in top_k], dtype=torch.long)
    k_on = (k > 0).to(x.device, non_blocking=True)[:, None]
    if all(p >= 1.0 for p in top_p):
        if not any(0 < kr < v for kr in top_k):
            return x
        column = (k.clamp(min=1) - 1).to(x.device, non_blocking=True)[:, None]
        kth = torch.topk(x, int(k.max())).values.gather(1, column)                  # [R, 1] k-th largest
        return x.masked_fill(k_on & (x < kth), float("-inf"))
    s, order = torch.sort(x, dim=-1, descending=True, stable=True)
    s, order = s.flip(-1), order.flip(-1)                          # [R, V] ascending, ties: the higher id first
    kth = s.gather(1, (v - k.clamp(min=1)).to(x.device, non_blocking=True)[:, None])      # [R, 1] k-th largest
    remove = k_on & (s < kth)
    s = s.masked_fill(remove, float("-inf"))
    # (1 - p) in float64 then in x's dtype: what comparing the fp32 sums with the python float (1 - p) does
    below = torch.tensor([1.0 - p for p in top_p], dtype=x.dtype).to(x.device, non_blocking=True)[:, None]
    p_on = torch.tensor([p < 1.0 for p in top_p]).to(x.device, non_blocking=True)[:, None]
    remove |= p_on & (s.softmax(-1).cumsum(-1) <= below)
    remove[:, -1] = False                                                           # the most likely stays
    return x.masked_fill(remove.scatter(1, order, remove), float("-inf"))


class Sampler:
    def __init__(self, device: "DeviceKind | torch.device | str", draw: Optional[Draw] = None):
        """`device`: the model's (rank 0's) device kind, or the device by name, where its logits are; it picks the
        draw (`draw` instead: the tests run a GPU's draw on host tensors), the plain greedy argmax and how results
        reach the host."""
        kind = device_kind_of(device)
        on_host = kind.samples_on_host
        self.draw: Draw = draw or (multinomial_draws if on_host else gumbel_draws)
        self._to_host = kind.copy_to_host
        self._greedy = _greedy_on_host if on_host else self._greedy_on_device

    def sample_rows(self, logits: torch.Tensor, rows: list[Row],
                    guided_masks: Optional[tuple[list[int], object]] = None) -> list[SampleResult]:
        """Every row of logits [N, V] with its (state, all_ids, output_ids): start_rows, then its results."""
        return self.start_rows(logits, rows, guided_masks).results()

    def start_rows(self, logits: torch.Tensor, rows: list[Row],
                   guided_masks: Optional[tuple[list[int], object]] = None) -> PendingSample:
        """A batch of plain greedy rows (no penalties, logprobs or masked EOS) takes one argmax; any other row sends
        the whole batch through the chain. `guided_masks` = (row indices, their llguidance bitmask, an int32 numpy
        array): applied to `logits` in place first, then the rows' logit_bias (logit_bias.py). `logits` are not
        changed otherwise."""
        if guided_masks is not None:
            with torch.inference_mode():   # the runner's logits are inference tensors
                apply_masks(logits, *guided_masks)
        apply_logit_bias(logits, rows)     # in place too: every later stage (logprobs included) sees the bias
        if all(plain_greedy(state.gen, len(all_ids)) for state, all_ids, _ in rows):
            return self._greedy(logits)
        return self._chain(logits, rows)

    @torch.inference_mode()
    def _chain(self, logits: torch.Tensor, rows: list[Row]) -> PendingSample:
        """The whole chain on the rows, queued on the logits' device; the host's values in one tensor."""
        n, v = logits.shape
        dev = logits.device
        gens = [st.gen for st, _, _ in rows]

        def idx(ids: list[int]) -> torch.Tensor:
            return _on(dev, ids, torch.long)

        def pick(x: torch.Tensor, sel: list[int], of: int) -> torch.Tensor:   # rows `sel` of x's `of` rows
            return x if len(sel) == of else x[idx(sel)]
        eos = [suppresses_eos(st.gen, len(a)) for st, a, _ in rows]
        argmax_only = [g.is_greedy and not g.has_penalties and not eos[i] for i, g in enumerate(gens)]
        work = [i for i in range(n) if not argmax_only[i]]            # rows with penalties, a masked EOS or a draw
        if not work:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=dev)
            if len(work) < n:
                rest = idx([i for i in range(n) if argmax_only[i]])
                tokens[rest] = logits[rest].argmax(-1)
            pen = [j for j, i in enumerate(work) if gens[i].has_penalties]
            masked = [(j, t) for j, i in enumerate(work) if eos[i] for t in gens[i].eos_token_ids]
            # a copy where rows are picked or changed: the raw logits stay for the logprobs
            x = logits if len(work) == n and not (pen or masked) else logits[idx(work)]
            if len(pen) == len(work):
                x = apply_penalties_rows(x, [rows[i] for i in work])
            elif pen:
                p = idx(pen)
                x[p] = apply_penalties_rows(x[p], [rows[work[j]] for j in pen])
            if masked:
                x[idx([j for j, _ in masked]), idx([t for _, t in masked])] = float("-inf")
            greedy = [j for j, i in enumerate(work) if gens[i].is_greedy]
            if greedy:
                tokens[idx([work[j] for j in greedy])] = pick(x, greedy, len(work)).argmax(-1)
            drawn = [j for j, i in enumerate(work) if not gens[i].is_greedy]
            if drawn:
                d = [work[j] for j in drawn]
                xs = pick(x, drawn, len(work)) / _on(dev, [gens[i].temperature for i in d], x.dtype)[:, None]
                if any(0 < gens[i].top_k < v or gens[i].top_p < 1.0 for i in d):
                    xs = mask_top_k_top_p(xs, [gens[i].top_k for i in d], [gens[i].top_p for i in d])
                tokens[idx(d)] = self.draw(xs, [rows[i] for i in d])
        parts = [tokens.double()]
        lp = [i for i, g in enumerate(gens) if g.logprobs]
        # (k, rows): one topk per count asked for, so a row's top_logprobs are those of a topk of its own count
        groups = [(k, [i for i in lp if gens[i].top_logprobs == k])
                  for k in sorted({gens[i].top_logprobs for i in lp} - {0})]
        if lp:
            raw = torch.log_softmax(pick(logits, lp, n), -1)                        # [L, V] of the raw logits
            parts.append(raw.gather(1, pick(tokens, lp, n)[:, None]).double().flatten())
            at = {i: j for j, i in enumerate(lp)}
            for k, sel in groups:
                top = torch.topk(pick(raw, [at[i] for i in sel], len(lp)), k)      # [len(sel), k]
                parts += [top.values.double().flatten(), top.indices.double().flatten()]
        host, ready = self._to_host(torch.cat(parts))
        return PendingSample(tokens, host, ready, lambda values: _results(values, n, lp, groups))

    @torch.inference_mode()
    def _greedy_on_device(self, logits: torch.Tensor) -> PendingSample:
        tokens = logits.argmax(-1)
        host, ready = self._to_host(tokens)
        return PendingSample(tokens, host, ready, lambda ids: [SampleResult(t) for t in ids])


def _greedy_on_host(logits: torch.Tensor) -> PendingSample:
    ids = argmax(logits)
    return PendingSample(torch.tensor(ids, dtype=torch.long), results=[SampleResult(t) for t in ids])


def _results(host: list[float], n: int, lp: list[int], groups: list[tuple[int, list[int]]]) -> list[SampleResult]:
    """Unpack the chain's one transfer: n ids, the logprob of each row of `lp`, then per (k, rows) of `groups` the
    top k values and then the top k ids of each of its rows."""
    results = [SampleResult(int(t)) for t in host[:n]]
    for j, i in enumerate(lp):
        results[i].logprob = host[n + j]
    at = n + len(lp)
    for k, sel in groups:
        values, ids = host[at:at + len(sel) * k], host[at + len(sel) * k:at + 2 * len(sel) * k]
        at += 2 * len(sel) * k
        for r, i in enumerate(sel):
            results[i].top_logprobs = [(int(t), v) for t, v in zip(ids[r * k:(r + 1) * k], values[r * k:(r + 1) * k])]
    return results
