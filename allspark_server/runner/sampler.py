"""Sampler (rank 0 only): turns each request's logits row into its next token.

Order, per row: the guided-output mask of requests with a response_format (disallowed tokens -inf; their
logprobs are those of the constrained distribution), raw logprobs (for the `logprobs` output), repetition penalty over prompt + output,
presence and frequency penalties over the output, min_length (EOS masked), then greedy argmax or
temperature -> top_k -> top_p -> a draw from the request's own seeded generator. Rows are handled
independently, so a request's tokens do not depend on the rest of the batch. Host logits go row by row here;
GPU logits stay on the GPU (batch_sampler.py: the same chain vectorized, counter-based seeded draws), and
`start_rows` only launches their sampling: the tokens stay on the GPU (the next decode step can read them there)
and the host learns them when it asks (`PendingSample.results`), from a copy queued at once.
"""
from __future__ import annotations

from typing import Optional

import torch

from allspark_client.generation_config import GenerationConfig
from allspark_server.runner.batch_sampler import sample_batch_start
from allspark_server.runner.guided import apply_masks
from allspark_server.runner.sample_types import PendingSample, SampleResult, SamplingState, suppresses_eos


def apply_penalties(x: torch.Tensor, all_ids: list[int], output_ids: list[int], gen: GenerationConfig) -> None:
    """In place on one row x [V]."""
    if gen.repetition_penalty != 1.0 and all_ids:
        ids = torch.tensor(all_ids, dtype=torch.long)
        score = x.gather(0, ids)
        score = torch.where(score < 0, score * gen.repetition_penalty, score / gen.repetition_penalty)
        x.scatter_(0, ids, score)
    if (gen.presence_penalty or gen.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=x.shape[0]).to(x.dtype)
        x -= gen.frequency_penalty * counts + gen.presence_penalty * (counts > 0).to(x.dtype)


def mask_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    if 0 < k < x.shape[-1]:
        kth = torch.topk(x, k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


def mask_top_p(x: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return x
    sorted_x, order = torch.sort(x, descending=False)
    cum = sorted_x.softmax(-1).cumsum(-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return x.masked_fill(remove, float("-inf"))


def argmax(x: torch.Tensor) -> "int | list[int]":
    """The first index of the largest value along the last dim (a NaN counts as largest, as in torch.argmax):
    an int for one row, a list for rows. Host fp32 goes to numpy, far cheaper than torch.argmax on a row, which
    every greedy token pays (docs/performance.md, "Choices in the code"); a GPU's rows stay there, only ids come
    back."""
    if x.dtype == torch.float32 and not x.is_cuda:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def plain_greedy(gen: GenerationConfig, num_tokens: int) -> bool:
    """Greedy with no penalties, logprobs or masked EOS at `num_tokens`: the row's token is its logits' argmax.
    True at `num_tokens` means true at every later count too (min_length only stops applying)."""
    return gen.is_greedy and not gen.logprobs and not gen.has_penalties and not suppresses_eos(gen, num_tokens)


class Sampler:
    def sample_rows(self, logits: torch.Tensor, rows: list[tuple[SamplingState, list[int], list[int]]],
                    guided_masks: Optional[tuple[list[int], object]] = None) -> list[SampleResult]:
        """Every row of logits [N, V] (on the host or a GPU) with its (state, all_ids, output_ids): start_rows,
        then its results."""
        return self.start_rows(logits, rows, guided_masks).results()

    def start_rows(self, logits: torch.Tensor, rows: list[tuple[SamplingState, list[int], list[int]]],
                   guided_masks: Optional[tuple[list[int], object]] = None) -> PendingSample:
        """Plain greedy rows (no penalties, logprobs or masked EOS) take one argmax over all of them together.
        On a GPU any other row sends the whole batch to `batch_sampler.sample_batch_start` (only ids and requested
        logprobs leave the GPU); on the host the others go through `sample_row`. `guided_masks` = (row indices,
        their llguidance bitmask, an int32 numpy array): applied to `logits` in place first."""
        if guided_masks is not None:
            with torch.inference_mode():   # the runner's logits are inference tensors
                apply_masks(logits, *guided_masks)
        plain = [i for i, (state, all_ids, _) in enumerate(rows) if plain_greedy(state.gen, len(all_ids))]
        if logits.is_cuda:
            if len(plain) < len(rows):
                return sample_batch_start(logits, rows)
            with torch.inference_mode():
                tokens = logits.argmax(-1)
            return PendingSample(tokens, tokens, lambda ids: [SampleResult(t) for t in ids])
        results: list[SampleResult | None] = [None] * len(rows)
        if plain:
            for i, token in zip(plain, argmax(logits if len(plain) == len(rows) else logits[plain])):
                results[i] = SampleResult(token)
        if len(plain) < len(rows):
            host = logits.cpu()
            for i, (state, all_ids, output_ids) in enumerate(rows):
                if results[i] is None:
                    results[i] = self.sample_row(host[i], state, all_ids, output_ids)
        return PendingSample(torch.tensor([r.token_id for r in results]), results=results)

    def sample_row(self, logits: torch.Tensor, state: SamplingState, all_ids: list[int],
                   output_ids: list[int]) -> SampleResult:
        gen = state.gen
        raw_logprobs = torch.log_softmax(logits, -1) if gen.logprobs else None
        suppress_eos = suppresses_eos(gen, len(all_ids))
        x = logits.clone() if gen.has_penalties or suppress_eos else logits   # edited in place below
        if gen.has_penalties:
            apply_penalties(x, all_ids, output_ids, gen)
        if suppress_eos:
            x[list(gen.eos_token_ids)] = float("-inf")
        if gen.is_greedy:
            token = argmax(x)
        else:
            x = x / gen.temperature
            x = mask_top_k(x, gen.top_k)
            x = mask_top_p(x, gen.top_p)
            probs = torch.softmax(x, -1)
            token = int(torch.multinomial(probs, 1, generator=state.generator))
        result = SampleResult(token)
        if raw_logprobs is not None:
            result.logprob = float(raw_logprobs[token])
            if gen.top_logprobs:
                top = torch.topk(raw_logprobs, gen.top_logprobs)
                result.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
        return result
