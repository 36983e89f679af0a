"""A tiny base model and random LoRA adapters of it made with PEFT (the reference the LoRA tests check against)."""
from __future__ import annotations

import dataclasses

import torch
from peft import LoraConfig, get_peft_model

from allspark_server.loader.tiny_model import build_tiny_model

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANT = "llama_gqa_llama3"


@dataclasses.dataclass
class Adapter:
    name: str
    folder: str             # the PEFT folder (adapter_config.json + adapter_model.safetensors)
    rank: int
    peft: torch.nn.Module   # transformers + PEFT, fp32, eval mode


def make_adapter(base_dir: str, folder: str, name: str, rank: int, seed: int, targets=SEVEN,
                 variant: str = VARIANT, hidden_size: int = 64, **config) -> Adapter:
    """A random adapter (B non-zero: init_lora_weights=False) of the tiny model in base_dir, saved to `folder`."""
    model = build_tiny_model(base_dir, variant, seed=1, tokenizer=False, hidden_size=hidden_size)
    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, **config)
    peft = get_peft_model(model, lora)
    peft.save_pretrained(folder)
    return Adapter(name, folder, rank, peft.eval())


def make_base(base_dir: str, variant: str = VARIANT):
    """The tiny base model (the same weights make_adapter starts from)."""
    return build_tiny_model(base_dir, variant, seed=1, tokenizer=False)
