"""Prompt logprobs and embeddings on a GPU rank (marker `gpu`, skipped without CUDA): every prompt position's
log-softmax and the pooled final-norm hidden states equal transformers', with the prefix cache holding the prompt,
with chunked prefill, and beside decode steps replayed from the CUDA graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import generate, greedy, random_prompt, run_together, serialize
from prompt_rows_helpers import check_prompt_logprobs, hf_embedding

from allspark_client.types import TargetDevice
from allspark_server import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_prompt_rows_on_the_gpu_equal_transformers(llama, tmp_path):
    loader = serialize(llama.hf_dir, "g", str(tmp_path))
    engine = Engine()
    for name, prefill in (("g", 0), ("chunked", 8)):
        engine.install_model(loader.create_reference_runtime_config_builder(name, TargetDevice.CUDA, [0], max_batch=4)
                             .max_length(256).kv_cache_span_size(16).max_prefill_length(prefill).build())
        engine.start_model(name)
    try:
        ids = random_prompt(45, seed=3)
        gen = {"top_k": 1, "max_new_tokens": 3, "eos_token_id": [], "prompt_logprobs": 2}
        for name in ("chunked", "g", "g"):                   # the second time on "g" its prefix is cached
            check_prompt_logprobs(llama.model, ids, generate(engine, name, ids, gen)[1][0], 2)
        # beside plain decodes (graph steps) and an embedding
        others = [(random_prompt(9, seed=4), {"top_k": 1, "max_new_tokens": 30, "eos_token_id": []})]
        out = run_together(engine, "g", others + [(ids, gen)])
        assert out[0][0] == greedy(engine, "g", others[0][0], 30)
        check_prompt_logprobs(llama.model, ids, out[1][1][0], 2)
        inputs = [random_prompt(n, seed=50 + n) for n in (1, 33)]
        for pooling in ("last", "mean"):
            for v, x in zip(engine.embed("chunked", inputs, pooling, True), inputs):
                np.testing.assert_allclose(v, hf_embedding(llama.model, x, pooling, True), atol=2e-5, rtol=1e-5)
    finally:
        engine.close()
