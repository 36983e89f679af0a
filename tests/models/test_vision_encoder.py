"""allspark_server.vision against transformers on tiny random Qwen2-VL and Qwen2.5-VL folders (tests/vl_cases.py):
the vision encoder's embeddings (1 and 2 images of different sizes, a 2-frame grid, bf16), the M-RoPE positions
and rope_delta (`get_rope_index`, with 0, 1 and 2 images and a video), the inputs helper (the folder's processor
output for the same images), and bad images refused with a clear ImageError."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import vl_cases as V

from allspark_server.vision.encoder import VisionEncoder
from allspark_server.vision.image_files import ImageError, decode_data_url, image_hashes, load_image
from allspark_server.vision.mrope import generated_position, rope_index
from allspark_server.vision.processor import VisionProcessor

IMAGES = {"wide": (84, 56, 1), "tall": (56, 112, 2)}        # (width, height, seed): 56x84 and 112x56 pixels


@pytest.fixture(scope="module", params=list(V.FAMILIES))
def case(request, tmp_path_factory):
    """(family, folder, transformers model, its config.json, the folder's transformers processor)."""
    family = request.param
    folder = str(tmp_path_factory.mktemp(family))
    model = V.build_vl_model(folder, family)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return family, folder, model, config, V.hf_processor(folder)


@pytest.fixture(scope="module")
def encoder(case):
    return VisionEncoder.from_hf(case[1])


def images(*names):
    return [V.make_image(*IMAGES[n]) for n in names]


def hf_embeds(model, pixel_values, grid) -> torch.Tensor:
    with torch.no_grad():
        return model.model.visual(torch.as_tensor(pixel_values), grid_thw=torch.as_tensor(grid)).pooler_output


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5):
    assert got.shape == want.shape
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < rel, f"relative error {err:.2e} over {rel:.0e}"


@pytest.mark.parametrize("names", [("wide",), ("wide", "tall"), ("tall", "wide")])
def test_encoder_matches_transformers(case, encoder, names):
    family, folder, model, _, processor = case
    out = V.hf_inputs(folder, images(*names), processor=processor)
    pv, grid = out["pixel_values"], out["image_grid_thw"]
    got = encoder(pv, grid)
    assert_close(got, hf_embeds(model, pv, grid))
    per_image = encoder.split(got, grid)
    assert [len(e) for e in per_image] == encoder.tokens_per_image(grid) == [int(np.prod(g)) // 4 for g in grid]
    alone = encoder(pv[:int(np.prod(grid[0]))], grid[:1])      # an image's embeddings do not depend on its batch
    assert_close(per_image[0], alone, 1e-6)
    if len(names) == 2:                                         # two requests of one image each, in one forward
        first = int(np.prod(grid[0]))
        batched = encoder.encode_batch([(pv[:first], grid[:1]), (pv[first:], grid[1:])])
        assert [len(r) for r in batched] == [1, 1]
        assert_close(batched[0][0], per_image[0], 1e-6)
        assert_close(batched[1][0], per_image[1], 1e-6)


def test_encoder_frames_and_state_dict(case, encoder):
    """A 2-frame grid (video-shaped) against transformers; the tower built from a config dict and a state dict
    (`visual.*` as allspark's model file stores it, or bare names) equals the one read from the folder."""
    family, folder, model, config, _ = case
    torch.manual_seed(0)
    pv, grid = torch.randn(2 * 4 * 6 + 8 * 4, encoder.cfg.patch_dim), torch.tensor([[2, 4, 6], [1, 8, 4]])
    want = hf_embeds(model, pv, grid)
    assert_close(encoder(pv, grid), want)
    state = model.model.visual.state_dict()
    for prefix in ("visual.", ""):
        built = VisionEncoder.from_hf(config, {prefix + k: v for k, v in state.items()})
        assert_close(built(pv, grid), want)


def test_encoder_bf16(case):
    family, folder, model, _, processor = case
    out = V.hf_inputs(folder, images("wide", "tall"), processor=processor)
    got = VisionEncoder.from_hf(folder, dtype=torch.bfloat16)(out["pixel_values"], out["image_grid_thw"])
    assert got.dtype == torch.bfloat16
    assert_close(got, hf_embeds(model, out["pixel_values"], out["image_grid_thw"]), 5e-2)


def test_encoder_refuses_mismatched_inputs(encoder):
    with pytest.raises(ValueError, match="pixel_values must be"):
        encoder(torch.zeros(24, 10), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="covers 24 patches but pixel_values has 20"):
        encoder(torch.zeros(20, encoder.cfg.patch_dim), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        encoder(torch.zeros(15, encoder.cfg.patch_dim), torch.tensor([[1, 3, 5]]))


@pytest.mark.parametrize("names", [(), ("wide",), ("wide", "tall")])
def test_mrope_matches_get_rope_index(case, names):
    """Text before, between and after the images (tests/vl_cases.chat)."""
    family, folder, model, config, processor = case
    out = V.hf_inputs(folder, images(*names), processor=processor)
    grid = out.get("image_grid_thw")
    want, want_delta = model.model.get_rope_index(torch.from_numpy(out["input_ids"]),
                                                  torch.from_numpy(out["mm_token_type_ids"]),
                                                  image_grid_thw=None if grid is None else torch.from_numpy(grid))
    got, delta = rope_index(out["input_ids"][0], grid, config)
    assert got.dtype == np.int64 and np.array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta)
    if names:
        assert delta < 0 and generated_position(len(got[0]), delta) == got.max() + 1


def test_mrope_video_matches_get_rope_index(case):
    family, folder, model, config, _ = case
    image, video = config["image_token_id"], config["video_token_id"]
    ids = [20, 21, 3] + [video] * (3 * 2 * 3) + [4, 22] + [3] + [image] * 6 + [4, 23, 24]
    types = [2 if t == video else 1 if t == image else 0 for t in ids]
    seconds = [0.7] if family == "qwen2_5_vl" else None
    extra = {"second_per_grid_ts": torch.tensor(seconds)} if seconds else {}
    want, want_delta = model.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                                  image_grid_thw=torch.tensor([[1, 4, 6]]),
                                                  video_grid_thw=torch.tensor([[3, 4, 6]]), **extra)
    got, delta = rope_index(ids, [[1, 4, 6]], config, video_grid_thw=[[3, 4, 6]], second_per_grid_ts=seconds)
    assert np.array_equal(got, want[:, 0].numpy()) and delta == int(want_delta)


def test_mrope_refuses_mismatched_tokens(case):
    config = case[3]
    image = config["image_token_id"]
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        rope_index([1, image, image, 2], [[1, 4, 6]], config)
    with pytest.raises(ValueError, match="more image tokens"):
        rope_index([1] + [image] * 7, [[1, 4, 6]], config)
    with pytest.raises(ValueError, match="2 image grid"):
        rope_index([1] + [image] * 6, [[1, 4, 6], [1, 4, 6]], config)


def test_inputs_match_the_processor(case):
    """Data URLs, file bytes, PIL images and `images` placeholders all give the processor's arrays."""
    family, folder, _, _, processor = case
    pics = images("wide", "tall")
    want = V.hf_inputs(folder, pics, processor=processor)
    vp = VisionProcessor.from_folder(folder)
    by_url = vp(V.chat(2, urls=[V.data_url(p) for p in pics]))
    assert set(by_url) == {"input_ids", "pixel_values", "image_grid_thw"}
    assert by_url["input_ids"].dtype == np.int64 and by_url["input_ids"].ndim == 1
    assert np.array_equal(by_url["input_ids"], want["input_ids"][0])
    assert by_url["pixel_values"].dtype == np.float32 and np.array_equal(by_url["pixel_values"], want["pixel_values"])
    assert np.array_equal(by_url["image_grid_thw"], want["image_grid_thw"])
    assert by_url["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    by_placeholder = vp(V.chat(2), images=[V.image_bytes(pics[0]), pics[1]])
    parts = V.chat(2)
    parts[1]["content"][1] = {"type": "image", "image": pics[0]}
    parts[1]["content"][3] = {"type": "image_url", "image_url": V.data_url(pics[1], "JPEG")}   # the URL string
    mixed = vp(parts)
    for got in (by_placeholder, mixed):
        assert np.array_equal(got["input_ids"], by_url["input_ids"])
        assert np.array_equal(got["image_grid_thw"], by_url["image_grid_thw"])
    assert np.array_equal(by_placeholder["pixel_values"], by_url["pixel_values"])
    text_only = vp(V.chat(0))
    assert list(text_only) == ["input_ids"]
    assert np.array_equal(text_only["input_ids"], V.hf_inputs(folder, [], processor=processor)["input_ids"][0])


def test_image_hashes(case):
    vp = VisionProcessor.from_folder(case[1])
    a = vp.encode_images(images("wide", "tall"))
    b = vp.encode_images(images("tall"))
    ha, hb = image_hashes(a["pixel_values"], a["image_grid_thw"]), image_hashes(b["pixel_values"], b["image_grid_thw"])
    assert len(ha) == 2 and ha[1] == hb[0] and ha[0] != ha[1]
    assert image_hashes(a["pixel_values"], a["image_grid_thw"]) == ha
    with pytest.raises(ValueError, match="covers"):
        image_hashes(a["pixel_values"][:-1], a["image_grid_thw"])


def _truncated_png() -> bytes:
    data = V.image_bytes(V.make_image(64, 64, 5))
    return data[:len(data) // 2]


@pytest.mark.parametrize("source, message", [
    (b"hello, not an image", "not an image"),
    (b"", "empty"),
    ("__truncated__", "corrupt"),
    (12345, "not int"),
    (["data:"], "not list"),
    ("https://example.com/cat.png", "'https'.*only data: URLs"),
    ("file:///etc/passwd", "'file'.*remote and file URLs are refused"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:image/png,rawbytes", "not base64"),
])
def test_bad_images_are_refused(source, message):
    if source == "__truncated__":
        source = _truncated_png()
    with pytest.raises(ImageError, match=message):
        load_image(source)


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header says `width` x `height` pixels (its IHDR rewritten, the CRC fixed)."""
    import struct
    import zlib
    data = bytearray(V.image_bytes(V.make_image(8, 8, 8)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    return bytes(data)


@pytest.mark.parametrize("side", [9000, 20000])     # over our bound; over Pillow's own (it raises in open)
def test_decompression_bomb_is_refused_from_the_header(side):
    with pytest.raises(ImageError, match="pixels"):
        load_image(_png_claiming(side, side))


def test_image_limits():
    big = V.make_image(40, 30, 6)
    with pytest.raises(ImageError, match="1200 pixels is over the limit of 1000"):
        load_image(V.image_bytes(big), max_pixels=1000)
    with pytest.raises(ImageError, match="1200 pixels is over the limit of 1000"):
        load_image(big, max_pixels=1000)
    with pytest.raises(ImageError, match="bytes is over the limit of 100"):
        load_image(V.image_bytes(big), max_bytes=100)
    with pytest.raises(ImageError, match="more than 100 bytes"):
        decode_data_url(V.data_url(big), max_bytes=100)
    with pytest.raises(ImageError, match="aspect ratio over 200"):
        load_image(V.make_image(402, 2, 7))
    assert load_image(V.data_url(big)).size == (40, 30)


def test_config_of_older_files():
    """config.json as transformers 4 wrote it: flat text keys, no rope_parameters in vision_config, in_chans."""
    from allspark_server.vision.tower_config import VisionConfig
    old2 = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
            "image_token_id": 151655, "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
            "in_chans": 3, "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    cfg = VisionConfig.from_hf(old2)
    assert (cfg.family, cfg.dim, cfg.mlp_dim, cfg.hidden_act, cfg.out_dim, cfg.head_dim, cfg.patch_dim,
            cfg.window_size) == ("qwen2_vl", 1280, 5120, "quick_gelu", 1536, 80, 1176, 0)
    old25 = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": 151655,
             "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                               "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                               "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                               "tokens_per_second": 2, "temporal_patch_size": 2}}
    cfg = VisionConfig.from_hf(old25)
    assert (cfg.family, cfg.mlp_dim, cfg.out_dim, cfg.window_size, cfg.fullatt_block_indexes, cfg.tokens_per_second,
            cfg.is_windowed(7), cfg.is_windowed(8)) == ("qwen2_5_vl", 3420, 3584, 112, (7, 15, 23, 31), 2, False, True)
    with pytest.raises(ValueError, match="not a Qwen2-VL"):
        VisionConfig.from_hf({"architectures": ["LlamaForCausalLM"]})


def test_inputs_name_the_bad_part(case):
    vp = VisionProcessor.from_folder(case[1])
    chat = V.chat(1, urls=["data:image/png;base64,aGVsbG8="])
    with pytest.raises(ImageError, match=r"messages\[1\]\.content\[1\]: not an image"):
        vp(chat)
    with pytest.raises(ValueError, match="no image is left"):
        vp(V.chat(2), images=images("wide"))
    with pytest.raises(ValueError, match="have no image placeholder"):
        vp(V.chat(1), images=images("wide", "tall"))
    with pytest.raises(ValueError, match="must be text, image_url or image"):
        vp([{"role": "user", "content": [{"type": "audio"}]}])
