"""Qwen2-VL and Qwen2.5-VL through ClientEngine on a real 2-rank pool: images travel in the request
(GenerateRequest.images), rank 0 encodes them and both ranks place the embeddings; greedy output equals
transformers' `generate` with 1 and 2 images batched with a text-only request, and a bad image input comes back as
PARAM_ERROR naming the problem while the pool keeps serving; bf16 weights by the families' near-tie rule."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import collect, installed_on_pool, random_prompt, serialize
from test_vl_engine import GREEDY, assert_greedy_up_to_near_ties, engine_inputs, hf_greedy, processed, run_all
from vl_cases import build_vl_model, hf_processor

from allspark_client.types import AsStatus

NAME = "vl-pool"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_images_through_a_pool_equal_transformers(pool, tmp_path, family):
    client, _ = pool
    folder = str(tmp_path / family)
    hf = build_vl_model(folder, family)
    processor = hf_processor(folder)
    loader = serialize(folder, NAME, folder + "/out")
    cases = [processed(folder, processor, n, seed=7) for n in (1, 2)]
    want = [hf_greedy(hf, c) for c in cases]
    text = random_prompt(20, seed=9, vocab=400)
    with installed_on_pool(client, loader, NAME, max_length=512):
        requests = [engine_inputs(c) for c in cases] + [{"input_ids": text}]
        outs = run_all(client, requests, NAME)
        assert outs == want + [hf_greedy(hf, {"input_ids": np.asarray([text])})]
        bad = {**requests[0], "pixel_values": np.asarray(requests[0]["pixel_values"])[:, :-3]}
        status, handle, _ = client.start_request(NAME, bad, GREEDY)
        assert status == AsStatus.ALLSPARK_PARAM_ERROR and handle is None
        assert "values" in client.get_last_error()
        status, handle, queue = client.start_request(NAME, requests[0], GREEDY)
        assert status == AsStatus.ALLSPARK_SUCCESS
        assert collect(queue)[0] == want[0]
        client.release_request(NAME, handle)


def test_bf16_images_through_a_pool_up_to_near_ties(pool, tmp_path):
    """bf16 weights on the pool, by the families' rule (test_vl_engine.assert_greedy_up_to_near_ties)."""
    client, _ = pool
    folder = str(tmp_path / "qwen2_vl")
    hf = build_vl_model(folder, "qwen2_vl")
    processor = hf_processor(folder)
    cases = [processed(folder, processor, n, seed=70) for n in (1, 2)]
    with installed_on_pool(client, serialize(folder, NAME, folder + "/out", dtype="bfloat16"), NAME, max_length=512):
        outs = run_all(client, [engine_inputs(c) for c in cases], NAME)
    for case, tokens in zip(cases, outs):
        assert_greedy_up_to_near_ties(hf, case, tokens)
