"""Prompt logprobs' and embeddings' bookkeeping without a model: the scheduler's chunks (no prefix-cache hit, rows
marked, an embedding request finishing unsampled), the forward inputs' extra rows and targets, pooling against a
float64 computation, and the HTTP side's parsing and encodings (embeddings body, echo)."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from allspark_client.types import GeneratedElements
from allspark_server.core.prefix_cache import PrefixCache
from allspark_server.core.request import FinishReason, Request
from allspark_server.core.scheduler import Scheduler, SchedulerConfig
from allspark_server.core.span_manager import SpanManager
from allspark_server.http.echo import echo_tokens
from allspark_server.http.embeddings import EmbeddingsRequest, embeddings_body, parse_embeddings
from allspark_server.http.protocol import ApiError
from allspark_server.runner.row_outputs import pool_rows
from allspark_server.step.inputs import RequestMirror, build_forward_inputs

S = 4


def _scheduler(budget: int = 8):
    return Scheduler(SchedulerConfig(4, budget), SpanManager(32, S, PrefixCache("unit", S, 60.0)))


def _run(sched, reqs, steps: int = 20):
    """Add the requests, plan and 'sample' (token 7) until all finish or `steps` run out: the chunks, the events."""
    for req in reqs.values():
        sched.add(req)
    chunks, events = [], []
    for _ in range(steps):
        plan, _ = sched.schedule()
        if not plan.chunks:
            break
        chunks += plan.chunks
        sampled = {c.request_id: [7] for c in plan.chunks if c.needs_sample}
        events += sched.update(plan, sampled, reqs)
    return chunks, events


def test_prompt_logprobs_take_no_cached_prefix_and_mark_their_prompt_chunks():
    sched = _scheduler()
    prompt = list(range(10, 23))                                     # 13 tokens: 3 full spans
    first = Request(1, prompt, max_length=14)
    _run(sched, {1: first})
    assert sched.stats.prefix_cache_hit_tokens == 0
    plain, rows = Request(2, prompt, max_length=14), Request(3, prompt, max_length=16, prompt_logprobs_pending=True)
    chunks, _ = _run(sched, {2: plain, 3: rows})
    assert plain.prefix_cache_len == 12 and rows.prefix_cache_len == 0      # the plain one hits, the other computes
    mine = [c for c in chunks if c.request_id == 3]
    assert sum(c.num_tokens for c in mine if c.prompt_rows) == 13 and not rows.prompt_logprobs_pending
    assert not any(c.prompt_rows for c in mine[-2:])                         # decodes after the prompt: none
    assert not any(c.prompt_rows or c.hidden_rows for c in chunks if c.request_id == 2)


def test_an_embedding_request_samples_nothing_and_finishes_after_its_input():
    sched = _scheduler(budget=5)
    req = Request(1, list(range(10, 22)), max_length=13, embedding=True)
    chunks, events = _run(sched, {1: req})
    assert [c.num_tokens for c in chunks] == [5, 5, 2]
    assert all(c.hidden_rows and not c.needs_sample for c in chunks)
    assert events == [(req, [], FinishReason.EOS)] and req.output_ids == [] and req.is_finished
    assert sched.spans.num_used_spans == 0


def test_forward_inputs_list_the_prompt_rows_and_the_tokens_they_predict():
    from allspark_server.core.messages import ScheduledChunk
    tokens = [5, 6, 7, 8, 9]
    mirrors = {1: RequestMirror(tokens, [0, 1], 2), 2: RequestMirror([1, 2, 3], [2], 0)}
    chunks = (ScheduledChunk(1, 3, True, prompt_rows=True), ScheduledChunk(2, 3, False, hidden_rows=True))
    inputs = build_forward_inputs(chunks, mirrors, S)
    # request 1 computes positions 2..4: rows 0 and 1 predict positions 3 and 4; position 4 is the sampled row
    assert inputs.logit_rows.tolist() == [0, 1] and inputs.logit_targets == ((1, 3, 8), (1, 4, 9))
    assert inputs.sample_rows.tolist() == [2] and inputs.hidden_rows.tolist() == [3, 4, 5]
    assert inputs.hidden_request_ids == (2, 2, 2) and inputs.has_extra_rows


def test_pooling_equals_a_float64_computation():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 8, generator=g), torch.randn(2, 8, generator=g)]
    whole = torch.cat(parts).double()
    assert torch.equal(pool_rows(parts, "last", False), parts[1][-1])
    mean = whole.mean(0)
    assert torch.allclose(pool_rows(parts, "mean", False).double(), mean, atol=1e-7)
    assert torch.allclose(pool_rows(parts, "mean", True).double(), mean / mean.norm(), atol=1e-7)


@pytest.mark.parametrize("body, param", [({"input": []}, "input"), ({"input": [1, "a"]}, "input"),
                                         ({"input": [True]}, "input"), ({"input": "a", "dimensions": 0}, "dimensions"),
                                         ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                                         ({"input": "a", "pooling": "mean"}, "pooling"), ({}, "input")])
def test_embeddings_request_refusals(body, param):
    with pytest.raises(ApiError) as e:
        parse_embeddings({"model": "m", **body}, "m")
    assert e.value.status == 400 and e.value.param == param
    with pytest.raises(ApiError) as e:
        parse_embeddings({"model": "other", "input": "a"}, "m")
    assert e.value.status == 404


def test_embeddings_request_forms_and_base64():
    assert parse_embeddings({"model": "m", "input": "a"}, "m").inputs == ["a"]
    assert parse_embeddings({"model": "m", "input": [3, 4]}, "m").inputs == [[3, 4]]
    assert parse_embeddings({"model": "m", "input": [[3], "b"]}, "m").inputs == [[3], "b"]
    v = np.array([0.5, -1.25, 3e-8], dtype=np.float32)
    b64 = embeddings_body(EmbeddingsRequest("m", ["a"], "base64"), [v], 2)
    assert np.array_equal(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4"), v)
    plain = embeddings_body(EmbeddingsRequest("m", ["a"]), [v], 2)
    assert plain["data"][0]["embedding"] == [0.5, -1.25, float(np.float32(3e-8))]
    assert plain["usage"] == {"prompt_tokens": 2, "total_tokens": 2} and plain["object"] == "list"


def test_echo_tokens_carry_the_prompt_logprobs():
    el = GeneratedElements([9], prompt_logprobs=[None, -1.5, -0.25],
                           prompt_top_logprobs=[[], [(4, -1.0)], [(6, -0.25)]])
    tokens = echo_tokens([3, 5, 6], el, True)
    assert [(t.token_id, t.logprob, t.top) for t in tokens] == [(3, None, []), (5, -1.5, [(4, -1.0)]),
                                                               (6, -0.25, [(6, -0.25)])]
    assert echo_tokens([3, 5, 6], el, False) == [] and echo_tokens([3], GeneratedElements([9]), True) == []


def test_prompt_logprobs_in_blocks_equal_a_float64_log_softmax(monkeypatch):
    from allspark_server.runner import row_outputs
    monkeypatch.setattr(row_outputs, "LOGPROB_BLOCK_ROWS", 3)              # 7 rows: blocks of 3, 3 and 1
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 50, generator=g) * 4
    targets = tuple((1 if i < 4 else 2, i + 1, (i * 7) % 50) for i in range(7))
    got = row_outputs.prompt_logprobs(row_outputs.StepRows(logits, targets, {}), {1: 2, 2: 0}.get)
    ref = torch.log_softmax(logits.double(), -1)
    assert [p for p, _, _ in got[1]] == [1, 2, 3, 4] and [p for p, _, _ in got[2]] == [5, 6, 7]
    for i, (rid, _, token) in enumerate(targets):
        _, lp, top = got[rid][i if rid == 1 else i - 4]
        assert abs(lp - ref[i, token].item()) < 1e-5
        want = torch.topk(ref[i], 2)
        assert len(top) == (2 if rid == 1 else 0)
        assert [t for t, _ in top] == want.indices.tolist()[:len(top)]
        assert np.allclose([v for _, v in top], want.values.numpy()[:len(top)], atol=1e-5)
