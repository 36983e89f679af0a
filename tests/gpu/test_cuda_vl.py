"""Qwen2-VL and Qwen2.5-VL on a GPU rank (skipped without CUDA): greedy output equals transformers' `generate` with
0, 1 and 2 images of different sizes, alone and batched with a text-only request, fp32 (the vision tower and the
decoder on the GPU; the decode steps replayed from CUDA graphs, the prefill with the images' rows eager)."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompt, serialize
from test_vl_engine import IMAGE_SETS, engine_inputs, hf_greedy, hf_text_greedy, processed, run_all
from vl_cases import build_vl_model, hf_processor

from allspark_client.types import TargetDevice
from allspark_server import Engine

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_images_on_the_gpu_equal_transformers_alone_and_batched(tmp_path, family):
    folder = str(tmp_path / family)
    hf = build_vl_model(folder, family)
    processor = hf_processor(folder)
    loader = serialize(folder, "vl", folder + "/out")
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("vl", TargetDevice.CUDA, [0], max_batch=8)
           .max_length(512).kv_cache_span_size(16).max_prefill_length(24).build())
    engine.install_model(cfg)
    engine.start_model("vl")
    try:
        cases = [processed(folder, processor, n) for n in IMAGE_SETS]
        want = [hf_greedy(hf, c) for c in cases]
        text = random_prompt(30, seed=3, vocab=400)
        for case, expected in zip(cases, want):
            assert run_all(engine, [engine_inputs(case)]) == [expected]
        together = run_all(engine, [engine_inputs(c) for c in cases] + [{"input_ids": text}])
        assert together == want + [hf_text_greedy(hf, text)]
    finally:
        engine.close()
