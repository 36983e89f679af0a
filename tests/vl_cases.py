"""Tiny random Qwen2-VL / Qwen2.5-VL model folders for the vision-language tests (nothing downloaded).

`build_vl_model(folder, family)` writes a complete HF folder: config.json (a small text model with M-RoPE and a
small vision tower), random weights, a byte-level BPE tokenizer that knows the ChatML and vision special tokens, a
chat template that turns `image` / `image_url` content parts into `<|vision_start|><|image_pad|><|vision_end|>`,
and the image processor's preprocessor_config.json with small min/max pixels (so test images make a few patches).
`make_image`, `image_bytes` and `data_url` make deterministic test images; `hf_processor` loads the folder's
transformers processor (the reference for the inputs helper). The function names here are used by other test
files: keep them stable.
"""
from __future__ import annotations

import base64
import io
import os

FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Describe this image. What is in the picture? A red square on "
    "a blue background, two cats and a small house. Compare the two images: the first is wider than the second. "
    "user assistant system You are a helpful assistant. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100.\n"
) * 4
# ChatML with image / video parts as the Qwen2-VL templates render them (string contents as they are)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
# the image processor's pixel bounds: 56x56 .. 112x112 pixels (4 .. 16 merged tokens an image)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def build_vl_tokenizer(out_dir: str | None = None):
    """A fast BPE tokenizer with the ChatML and vision special tokens (ids 0..6, SPECIAL_TOKENS' order) and the
    chat template; saved into `out_dir` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 16, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def special_ids(tokenizer) -> dict[str, int]:
    """The config's token ids (image_token_id, video_token_id, vision_start_token_id, vision_end_token_id)."""
    get = tokenizer.convert_tokens_to_ids
    return dict(image_token_id=get("<|image_pad|>"), video_token_id=get("<|video_pad|>"),
                vision_start_token_id=get("<|vision_start|>"), vision_end_token_id=get("<|vision_end|>"))


def vl_config(family: str, tokenizer, hidden_size: int = 64, num_layers: int = 2, vision_depth: int = 3,
              vision_dim: int = 32, vision_heads: int = 2, window_size: int = 56, fullatt_block_indexes=(1,)):
    """The transformers config of a tiny model of `family` ("qwen2_vl" or "qwen2_5_vl"). Text: 4 heads of 16
    (2 KV heads), mrope_section [2, 3, 3]. Vision: `vision_depth` blocks of `vision_dim`, patch 14, merge 2;
    Qwen2.5-VL: windows of `window_size` pixels (2x2 merged tokens at 56) and full attention in
    `fullatt_block_indexes`."""
    import transformers

    if family not in FAMILIES:
        raise KeyError(f"no VL family {family!r}; known: {', '.join(FAMILIES)}")
    ids = special_ids(tokenizer)
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    if family == "qwen2_vl":
        vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=vision_heads,
                      mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg_cls = transformers.Qwen2VLConfig
    else:
        vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=2 * vision_dim,
                      out_hidden_size=hidden_size, num_heads=vision_heads, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=window_size, fullatt_block_indexes=list(fullatt_block_indexes),
                      tokens_per_second=2)
        cfg_cls = transformers.Qwen2_5_VLConfig
    return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _image_only(cls):
    """`cls` (a Qwen2-VL processor class) without its video processor: transformers' video processors need
    torchvision, which cannot be installed beside torch 2.13 here; images, text and the chat template work as in
    the full processor."""
    return type(f"ImageOnly{cls.__name__}", (cls,), {"get_attributes": classmethod(
        lambda c: ["image_processor", "tokenizer"])})


def build_processor(family: str, tokenizer, image_processor=None):
    """The transformers processor of a `family` folder (images and text; see _image_only): the PIL Qwen2-VL image
    processor (MIN_PIXELS / MAX_PIXELS unless `image_processor` is given), the tokenizer and the chat template."""
    import transformers

    if image_processor is None:
        image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                                                patch_size=14, merge_size=2, temporal_patch_size=2)
    cls = transformers.Qwen2VLProcessor if family == "qwen2_vl" else transformers.Qwen2_5_VLProcessor
    return _image_only(cls)(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_vl_model(out_dir: str, family: str = "qwen2_vl", seed: int = 0, dtype: str = "float32",
                   weight_scale: float | None = 0.05, **config_kw):
    """Write a tiny random `family` model folder (config, safetensors weights, tokenizer, chat template,
    preprocessor_config.json) into `out_dir`; returns the transformers model (eval mode, `dtype`).
    `weight_scale`: matrices and biases drawn from N(0, scale) (peakier logits than the default init)."""
    import torch
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_vl_tokenizer(out_dir)
    config = vl_config(family, tokenizer, **config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family])(config).eval()
    if weight_scale is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 or name.endswith("bias"):
                    p.normal_(0.0, weight_scale)
                elif "norm" in name or "ln_q" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    build_processor(family, tokenizer).image_processor.save_pretrained(out_dir)   # preprocessor_config.json
    return model


def hf_processor(folder: str):
    """The folder's processor as transformers loads it (image processor and tokenizer from the folder's files;
    the reference for allspark_server.vision.processor). Its output has `mm_token_type_ids`, which transformers'
    `generate` needs beside `input_ids`, `pixel_values` and `image_grid_thw`."""
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    family = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}[
        json.load(open(os.path.join(folder, "config.json")))["model_type"]]
    return build_processor(family, AutoTokenizer.from_pretrained(folder),
                           AutoImageProcessor.from_pretrained(folder))


def hf_inputs(folder: str, images: list, messages: list[dict] | None = None, processor=None) -> dict:
    """transformers' processor output (numpy arrays) for `images` in the chat `messages` (default: chat(n))."""
    processor = processor or hf_processor(folder)
    text = processor.apply_chat_template(messages or chat(len(images)), tokenize=False, add_generation_prompt=True)
    return dict(processor(text=[text], images=images or None, return_tensors="np"))


def hf_greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (new token ids) of one prompt's processor output (hf_inputs)."""
    import torch

    batch = {k: torch.as_tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A deterministic random-noise PIL image of `width` x `height` pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def image_bytes(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image, fmt: str = "PNG") -> str:
    """A `data:image/<fmt>;base64,...` URL of the image, as an OpenAI client sends it."""
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(image_bytes(image, fmt)).decode()}"


def chat(n_images: int, text: str = "Describe this image.", urls: list[str] | None = None) -> list[dict]:
    """A one-turn user chat with `n_images` image parts (OpenAI `image_url` parts when `urls` is given, else
    `{"type": "image"}` placeholders) between text parts, then the question."""
    content: list[dict] = [{"type": "text", "text": "Look:"}]
    for i in range(n_images):
        if urls is not None:
            content.append({"type": "image_url", "image_url": {"url": urls[i]}})
        else:
            content.append({"type": "image"})
        if i + 1 < n_images:
            content.append({"type": "text", "text": " and "})
    content.append({"type": "text", "text": " " + text})
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}]
