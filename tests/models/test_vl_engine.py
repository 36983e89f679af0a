"""Qwen2-VL and Qwen2.5-VL on the Engine: greedy output equals transformers' `generate` with 0, 1 and 2 images of
different sizes, alone and batched with a text-only request (fp32, tiny random models from tests/vl_cases.py);
chunked prefill splits image tokens across steps; a chat that sends the same image again hits the prefix cache,
another image with the same token ids does not; bad image inputs are refused naming the problem and the engine
keeps serving."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import collect, random_prompt, serialize, start_engine
from vl_cases import build_vl_model, hf_inputs, hf_processor, make_image

from allspark_client.types import AsStatus

NAME = "vl"
NEW_TOKENS = 12
GREEDY = {"top_k": 1, "max_new_tokens": NEW_TOKENS, "eos_token_id": []}
IMAGE_SETS = {0: [], 1: [(56, 84)], 2: [(84, 56), (112, 112)]}     # (width, height) of each image


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = build_vl_model(folder, request.param)
    loader = serialize(folder, NAME, folder + "/out")
    # a 24-token prefill budget: prompts with images run as several chunks, image tokens split between them
    engine = start_engine(loader, NAME, max_length=512, span_size=16, prefill=24)
    yield hf, engine, folder, hf_processor(folder)
    engine.close()


def processed(folder, processor, n: int, seed: int = 0) -> dict:
    images = [make_image(w, h, seed=seed + i) for i, (w, h) in enumerate(IMAGE_SETS[n])]
    return hf_inputs(folder, images, processor=processor)


def hf_greedy(hf, inputs: dict) -> list[int]:
    kw = {k: torch.as_tensor(v) for k, v in inputs.items()}
    prompt = kw["input_ids"].shape[1]
    out = hf.generate(**kw, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, prompt:].tolist()


def engine_inputs(inputs: dict) -> dict:
    out = {"input_ids": inputs["input_ids"][0].tolist()}
    if "pixel_values" in inputs:
        out.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    return out


def run_all(engine, requests: list[dict], name: str = NAME) -> list[list[int]]:
    started = [engine.start_request(name, r, GREEDY) for r in requests]
    try:
        assert all(st == AsStatus.ALLSPARK_SUCCESS for st, _, _ in started), engine.get_last_error()
        return [collect(q)[0] for _, _, q in started]
    finally:
        for st, handle, _ in started:
            if st == AsStatus.ALLSPARK_SUCCESS:
                engine.release_request(name, handle)


def test_greedy_equals_transformers_with_0_1_2_images_alone_and_batched(vl):
    hf, engine, folder, processor = vl
    cases = [processed(folder, processor, n) for n in IMAGE_SETS]
    want = [hf_greedy(hf, c) for c in cases]
    text = random_prompt(30, seed=3, vocab=400)
    want_text = hf_text_greedy(hf, text)
    for case, expected in zip(cases, want):            # alone
        assert run_all(engine, [engine_inputs(case)]) == [expected]
    # together, with a text-only request among them
    assert run_all(engine, [engine_inputs(c) for c in cases] + [{"input_ids": text}]) == want + [want_text]


def hf_text_greedy(hf, ids: list[int]) -> list[int]:
    return hf_greedy(hf, {"input_ids": np.asarray([ids])})


BF16_NEAR_TIE = 0.1   # as the text families' rule (test_model_families.py): bf16 moves these logits by up to ~0.04


def test_bf16_greedy_up_to_near_ties_with_images(vl, tmp_path):
    """bf16 weights: each token is the fp32 reference's argmax at that point or within BF16_NEAR_TIE of it, and
    the tokens before the first near tie are the reference's greedy ones (teacher-forced, with the images)."""
    hf, _, folder, processor = vl
    engine = start_engine(serialize(folder, "vl16", str(tmp_path), dtype="bfloat16"), "vl16", max_length=512)
    try:
        cases = [processed(folder, processor, n, seed=60) for n in (1, 2)]
        got = run_all(engine, [engine_inputs(c) for c in cases], "vl16")
    finally:
        engine.close()
    for case, tokens in zip(cases, got):
        assert_greedy_up_to_near_ties(hf, case, tokens)


def assert_greedy_up_to_near_ties(hf, case: dict, tokens: list[int]) -> None:
    """Each token is the fp32 reference's argmax at that point (teacher-forced, with the images) or within
    BF16_NEAR_TIE of it; the tokens before the first near tie are the reference's greedy ones."""
    prompt = case["input_ids"].shape[1]
    kw = {k: torch.as_tensor(v) for k, v in case.items()}
    kw["input_ids"] = torch.cat([kw["input_ids"], torch.tensor([tokens])], 1)
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    if "mm_token_type_ids" in kw:
        kw["mm_token_type_ids"] = torch.cat([kw["mm_token_type_ids"],
                                             torch.zeros(1, len(tokens), dtype=kw["mm_token_type_ids"].dtype)], 1)
    with torch.no_grad():
        ref = hf(**kw).logits[0, prompt - 1:-1].double()
    best, chosen = ref.max(-1).values, ref[torch.arange(len(tokens)), tokens]
    assert ((best - chosen) <= BF16_NEAR_TIE).all(), (best - chosen).tolist()
    top2 = ref.topk(2, -1).values
    tie_free = int(((top2[:, 0] - top2[:, 1]) > BF16_NEAR_TIE).to(torch.int).cumprod(0).sum())
    assert tokens[:tie_free] == ref.argmax(-1).tolist()[:tie_free]


def test_the_same_image_hits_the_prefix_cache_and_another_image_does_not(vl):
    hf, engine, folder, processor = vl
    first = processed(folder, processor, 1, seed=40)
    other = processed(folder, processor, 1, seed=41)     # the same size: the same token ids, other pixels
    assert np.array_equal(first["input_ids"], other["input_ids"])
    hits = engine.get_as_engine_stat(NAME).prefix_cache_hit_token
    assert run_all(engine, [engine_inputs(first)]) == [hf_greedy(hf, first)]
    assert engine.get_as_engine_stat(NAME).prefix_cache_hit_token == hits          # a new image: nothing cached
    assert run_all(engine, [engine_inputs(first)]) == [hf_greedy(hf, first)]
    again = engine.get_as_engine_stat(NAME).prefix_cache_hit_token
    assert again > hits                                                            # the same image: a hit
    assert run_all(engine, [engine_inputs(other)]) == [hf_greedy(hf, other)]
    assert engine.get_as_engine_stat(NAME).prefix_cache_hit_token == again         # its spans are not the first's


def test_bad_image_inputs_are_refused_and_the_engine_keeps_serving(vl):
    hf, engine, folder, processor = vl
    good = engine_inputs(processed(folder, processor, 1))
    pixels, grid = good["pixel_values"], good["image_grid_thw"]
    bad = {
        "need both": {**good, "image_grid_thw": None},
        "covers": {**good, "image_grid_thw": grid * np.array([[1, 2, 1]])},
        "NaN": {**good, "pixel_values": np.where(np.arange(pixels.size).reshape(pixels.shape) == 5, np.nan, pixels)},
        "image tokens": {**good, "input_ids": [t for t in good["input_ids"] if t != hf.config.image_token_id][:-1]
                         + [hf.config.image_token_id]},
        "values": {**good, "pixel_values": pixels[:, :-3]},
        "[images, 3]": {**good, "image_grid_thw": grid[:, :2]},
    }
    for words, inputs in bad.items():
        status, handle, queue = engine.start_request(NAME, inputs, GREEDY)
        assert status == AsStatus.ALLSPARK_PARAM_ERROR and handle is None, (words, status)
        assert words in engine.get_last_error(), (words, engine.get_last_error())
    text = {"input_ids": random_prompt(8, seed=5, vocab=400), "pixel_values": pixels, "image_grid_thw": grid}
    status, _, _ = engine.start_request(NAME, text, GREEDY)        # images but no image tokens in the prompt
    assert status == AsStatus.ALLSPARK_PARAM_ERROR and "image tokens" in engine.get_last_error()
    assert run_all(engine, [good]) == [hf_greedy(hf, processed(folder, processor, 1))]


def test_mrope_rows_equal_transformers_rotary():
    """Our table's rows for 3-D positions, column for column, equal Qwen2-VL's rotary (cos and sin) in fp32."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from allspark_server.layers.rotary import RotaryEmbedding

    section = [4, 6, 6]
    config = Qwen2VLTextConfig(hidden_size=256, num_attention_heads=8, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": section, "type": "mrope"})
    theirs = Qwen2VLRotaryEmbedding(config)
    ours = RotaryEmbedding(32, 4096, 1e6, None, mrope_section=tuple(section))
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4000, (3, 50), generator=g)
    positions[:, :10] = torch.arange(10)                       # text tokens: all three components equal
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])      # [3?, 1, T, D] -> [1, T, D]
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)                          # [T, 1, D]
    torch.testing.assert_close(our_cos[:, 0], cos.reshape(-1, 50, 32)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_sin[:, 0], sin.reshape(-1, 50, 32)[0], rtol=1e-5, atol=1e-5)
    plain_cos, _ = ours.cos_sin(positions[0, :10], torch.float32)                      # 1-D rows where equal
    assert torch.equal(plain_cos, our_cos[:10])
