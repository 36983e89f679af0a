"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the
language model is Qwen2's decoder (q/k/v biased) with M-RoPE, the multimodal rotary whose sections turn with a
token's temporal, height and width positions (`mrope_section`, layers/rotary.py). Its settings sit in
config.json's `text_config` (transformers 5) or at the top level (older files); the vision tower's tensors
(`visual.*`, `model.visual.*`) are not the decoder's and are read by allspark_server/vision."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from allspark_server.models.args import ModelArgs, args_from_hf_config
from allspark_server.models.registry import ArchSpec

_ROPE_KEYS = ("rope_parameters", "rope_scaling")
VISION_PREFIX = "visual."        # the vision tower's tensors in the model file


def text_config(hf: dict) -> dict:
    """The language model's settings: `text_config` over the top level (where older files keep them)."""
    return {**hf, **(hf.get("text_config") or {}), "architectures": hf["architectures"]}


def read_args(hf: dict, folder) -> ModelArgs:
    text = text_config(hf)
    section = ()
    for key in _ROPE_KEYS:   # {"type": "mrope", "mrope_section": [...]}: M-RoPE over otherwise plain frequencies
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            section = tuple(int(s) for s in rope["mrope_section"])
            rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "type")}
            if rope.get("rope_type") == "mrope":
                rope["rope_type"] = "default"
            text = {**text, key: rope}
    args = args_from_hf_config(text, qkv_bias_always=True)
    if section and (len(section) != 3 or sum(section) * 2 != args.num_rotary_dims):
        raise ValueError(f"mrope_section {list(section)} (config.json) must be three pair counts summing to "
                         f"head_dim / 2 = {args.num_rotary_dims // 2}")
    return replace(args, mrope_section=section)


def vision_tensor(name: str) -> Optional[str]:
    """The vision tower's tensors, as `visual.*` (stored beside the decoder's weights; vision/ reads them)."""
    for prefix in ("visual.", "model.visual."):
        if name.startswith(prefix):
            return VISION_PREFIX + name[len(prefix):]
    return None


def convert(name: str, tensor, args: ModelArgs):
    """The decoder's tensors under their canonical names."""
    if name.startswith("model.language_model."):          # transformers 5's own naming
        name = "model." + name[len("model.language_model."):]
    return ((name, tensor),)


ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": ArchSpec(read_args, convert, side=vision_tensor),
    "Qwen2_5_VLForConditionalGeneration": ArchSpec(read_args, convert, side=vision_tensor),
}
