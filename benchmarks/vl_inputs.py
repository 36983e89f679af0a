"""benchmarks/vl.py's models and prompts: a random Qwen2-VL-2B-shaped model (or tests/vl_cases.py's tiny one) saved
with the tiny tokenizer, chat template and image processor, the chats, the processor's batched output and one
allspark input dict per request."""
from __future__ import annotations


def config_2b(tokenizer):
    """transformers' Qwen2VLConfig of Qwen2-VL-2B's shapes, with the tiny tokenizer's special ids."""
    import transformers
    from vl_cases import special_ids

    text = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=True)
    vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                      **special_ids(tokenizer))


def build_2b(folder: str, device: str):
    """A random Qwen2-VL-2B-shaped bf16 model made on `device` and saved (with the tokenizer, chat template and
    image processor) into `folder`; returns (the transformers model, its processor)."""
    import torch
    import transformers
    from vl_cases import build_processor, build_vl_tokenizer

    tokenizer = build_vl_tokenizer(folder)
    image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                                                            patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = build_processor("qwen2_vl", tokenizer, image_processor)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2VLForConditionalGeneration._from_config(config_2b(tokenizer),
                                                                          dtype=torch.bfloat16).eval()
    model.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return model, processor


def build_tiny(folder: str, device: str):
    from vl_cases import build_vl_model, hf_processor
    model = build_vl_model(folder, "qwen2_vl").to(device)
    return model, hf_processor(folder)


def user_turn(i: int, image: bool = True) -> dict:
    content = [{"type": "image"}] if image else []
    content.append({"type": "text", "text": f"Describe picture {i}, please."})
    return {"role": "user", "content": content}


def chat(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."}, user_turn(i)]


def processed(processor, images: list, chats: list[list[dict]]) -> dict:
    """The processor's output (numpy) of one prompt per chat, left-padded."""
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=texts, images=images, padding=True, return_tensors="np"))


def engine_requests(batch: dict) -> list[dict]:
    """One allspark input dict per row of a processor batch (padding dropped, each row's own pixels)."""
    import numpy as np
    grid = batch["image_grid_thw"]
    patches = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    out = []
    for i in range(len(batch["input_ids"])):
        ids = batch["input_ids"][i][batch["attention_mask"][i].astype(bool)].tolist()
        out.append({"input_ids": ids, "pixel_values": batch["pixel_values"][patches[i]:patches[i + 1]],
                    "image_grid_thw": grid[i:i + 1]})
    return out
