"""Prompt logprobs and embeddings through ClientEngine on the session's 2-rank pool, against transformers: every
prompt position's log-softmax (whole prompt, a cached prefix, chunked prefill) and the final-norm hidden states
pooled last / mean. The Engine's side is tests/models/test_prompt_logprobs.py."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import collect, random_prompt
from prompt_rows_helpers import check_prompt_logprobs, hf_embedding

from allspark_client import AsException, GenerateRequestStatus

CHUNKED = "llama_chunked"


@pytest.fixture(scope="module")
def client(pool):
    """The pool's ClientEngine, with the model installed a second time prefilling 8 tokens a step."""
    client, loader = pool
    cfg = (loader.create_reference_runtime_config_builder(CHUNKED, "cpu", [0], max_batch=4)
           .max_length(256).kv_cache_span_size(16).max_prefill_length(8).build())
    assert client.install_model(cfg) == 0 and client.start_model(CHUNKED) == 0
    yield client
    assert client.stop_model(CHUNKED) == 0 and client.release_model(CHUNKED) == 0


def _first_element(client, name, ids, gen):
    status, handle, queue = client.start_request(name, {"input_ids": ids}, gen)
    assert status == 0, client.get_last_error()
    _, elements, final = collect(queue)
    assert final == GenerateRequestStatus.GenerateFinished
    client.release_request(name, handle)
    assert all(e.prompt_logprobs is None for e in elements[1:])
    return elements[0]


def test_pool_prompt_logprobs_equal_transformers(client, llama):
    ids = random_prompt(45, seed=7)
    gen = {"top_k": 1, "max_new_tokens": 2, "eos_token_id": [], "prompt_logprobs": 3}
    for name in (CHUNKED, "llama", "llama"):          # the second time on "llama" its prefix is cached
        check_prompt_logprobs(llama.model, ids, _first_element(client, name, ids, gen), 3)


def test_pool_embeddings_equal_transformers(client, llama):
    inputs = [random_prompt(n, seed=40 + n) for n in (3, 30)]
    for pooling in ("last", "mean"):
        for name, normalize in ((CHUNKED, False), ("llama", True)):
            got = client.embed(name, inputs, pooling=pooling, normalize=normalize)
            for ids, v in zip(inputs, got):
                assert v.dtype == np.float32
                np.testing.assert_allclose(v, hf_embedding(llama.model, ids, pooling, normalize), atol=2e-5,
                                           rtol=1e-5)


def test_pool_embed_refusals(client):
    with pytest.raises(AsException) as e:
        client.embed("llama", [[1, 2]], pooling="cls")
    assert "pooling" in str(e.value)
    with pytest.raises(AsException) as e:
        client.embed("no_such_model", [[1, 2]])
    assert "no_such_model" in str(e.value)
