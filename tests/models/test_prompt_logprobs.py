"""Prompt logprobs (GenerationConfig.prompt_logprobs) and embeddings (Engine.embed) against transformers: every
prompt position's log-softmax, whole prompt, chunked prefill and a prompt whose prefix is cached; the final-norm
hidden states pooled last / mean, normalized or not. The 2-rank pool's side is tests/pool/test_pool_prompt_rows.py."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import generate, greedy, random_prompt, run_together, serialize, start_engine
from prompt_rows_helpers import check_prompt_logprobs, hf_embedding

from allspark_client import AsException


@pytest.fixture(scope="module")
def loader(llama, tmp_path_factory):
    return serialize(llama.hf_dir, "rows", str(tmp_path_factory.mktemp("prompt_rows")))


@pytest.fixture(scope="module")
def engine(loader):
    """Prefix cache on (spans of 16), and a second model that prefills 8 tokens a step (chunked)."""
    e = start_engine(loader, "rows", max_batch=4, max_length=256, span_size=16)
    start_engine(loader, "chunked", engine=e, max_batch=4, max_length=256, span_size=16, prefill=8)
    yield e
    e.close()


def test_prompt_logprobs_equal_transformers_whole_and_chunked(engine, llama):
    ids = random_prompt(37, seed=1)
    for name in ("rows", "chunked"):
        tokens, elements = generate(engine, name, ids, {"top_k": 1, "max_new_tokens": 3, "eos_token_id": [],
                                                        "prompt_logprobs": 2})
        check_prompt_logprobs(llama.model, ids, elements[0], 2)
        assert all(e.prompt_logprobs is None for e in elements[1:])       # returned once
        assert tokens == greedy(engine, name, ids, 3)                      # generation unchanged


def test_prompt_logprobs_with_a_cached_prefix(engine, llama):
    ids = random_prompt(50, seed=2)
    greedy(engine, "rows", ids[:40], 2)                                     # spans 0-1 cached
    before = engine.get_as_engine_stat("rows").prefix_cache_hit_token
    _, elements = generate(engine, "rows", ids, {"top_k": 1, "max_new_tokens": 1, "prompt_logprobs": 0})
    check_prompt_logprobs(llama.model, ids, elements[0], 0)
    # the cached prefix was computed again for its logits; the spans it filled still serve a plain request
    assert engine.get_as_engine_stat("rows").prefix_cache_hit_token == before
    greedy(engine, "rows", ids, 1)
    assert engine.get_as_engine_stat("rows").prefix_cache_hit_token == before + 48


def test_prompt_logprobs_beside_other_requests(engine, llama):
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 23, 2)]
    gens = [{"top_k": 1, "max_new_tokens": 4, "eos_token_id": [], "prompt_logprobs": k} for k in (1, None, 3)]
    out = run_together(engine, "chunked", list(zip(prompts, gens)))
    for ids, gen, (tokens, elements) in zip(prompts, gens, out):
        assert tokens == greedy(engine, "chunked", ids, 4)
        if gen["prompt_logprobs"] is None:
            assert elements[0].prompt_logprobs is None
        else:
            check_prompt_logprobs(llama.model, ids, elements[0], gen["prompt_logprobs"])


@pytest.mark.parametrize("bad", [-1, 11, 1.5, "2", True])
def test_prompt_logprobs_out_of_range_is_refused(engine, bad):
    status, _, _ = engine.start_request("rows", {"input_ids": [1, 2]}, {"prompt_logprobs": bad})
    assert status != 0 and "prompt_logprobs" in engine.get_last_error()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embeddings_equal_transformers(engine, llama, pooling, normalize):
    inputs = [random_prompt(n, seed=30 + n) for n in (1, 9, 41)]
    for name in ("rows", "chunked"):
        got = engine.embed(name, inputs, pooling=pooling, normalize=normalize)
        for ids, v in zip(inputs, got):
            assert v.dtype == np.float32 and v.shape == (llama.model.config.hidden_size,)
            np.testing.assert_allclose(v, hf_embedding(llama.model, ids, pooling, normalize), atol=2e-5, rtol=1e-5)
    stat = engine.get_as_engine_stat("rows")
    assert (stat.running_request, stat.used_span) == (0, 0)


@pytest.mark.parametrize("args, what", [(([],), "input_ids_list"), (([[1, 2], []],), "input_ids_list[1]"),
                                        (([[1, 10**9]],), "input_ids_list[0]"),
                                        (([[1]], "max"), "pooling"), (([[1]], "last", 1), "normalize")])
def test_embed_refusals_name_the_argument(engine, args, what):
    with pytest.raises(AsException) as e:
        engine.embed("rows", *args)
    assert what in str(e.value)


def test_prompt_rows_survive_preemption(loader, llama):
    """8 spans of 16 tokens: three 40-token prompts decoding 40 tokens each and two embeddings cannot all fit, so
    requests are preempted (some in the middle of their prompt) and computed again; every prompt logprob and
    embedding still equals transformers'."""
    import threading

    from allspark_server.step.kv_cache import bytes_per_span
    args = loader.args
    budget = 8 * bytes_per_span(args.num_layers, 16, args.num_kv_heads, args.head_dim, loader.data_type)
    engine = start_engine(loader, "tight", max_batch=8, max_length=256, span_size=16, kv_bytes=budget, prefill=16)
    try:
        prompts = [random_prompt(40, seed=60 + i) for i in range(3)]
        inputs = [random_prompt(40, seed=70 + i) for i in range(2)]
        got = {}
        embedder = threading.Thread(target=lambda: got.setdefault("v", engine.embed("tight", inputs, "mean")))
        embedder.start()
        gen = {"top_k": 1, "max_new_tokens": 40, "eos_token_id": [], "prompt_logprobs": 1}
        out = run_together(engine, "tight", [(p, gen) for p in prompts])
        embedder.join(timeout=300)
        for ids, (_, elements) in zip(prompts, out):
            check_prompt_logprobs(llama.model, ids, elements[0], 1)
        for ids, v in zip(inputs, got["v"]):
            np.testing.assert_allclose(v, hf_embedding(llama.model, ids, "mean", False), atol=2e-5, rtol=1e-5)
        stat = engine.get_as_engine_stat("tight")
        assert stat.num_preempted > 0, "the budget was meant to force preemption"
        assert stat.used_span == 0
    finally:
        engine.release_model("tight")
