"""The SmolLM2 file's test case, built once per session for the Engine test (test_gguf_smollm2.py) and the pool
test (test_smollm2_serve.py): the file serialized by our loader (its Q4_1 weights kept as uint4_min), 8 chat
prompts, and transformers' fp32 greedy tokens for them (its GGUF loader dequantizes the same file). Loading
transformers' model of the file and generating 8 x 32 tokens with it is the slow part; both tests check against
the same reference."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow.", "How many legs does a spider have?",
             "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
             "Give me a synonym for happy.", "Why is the sky blue?"]
NEW_TOKENS = 32


@dataclass
class SmolLM2Case:
    loader: object                 # HuggingFaceModel of the file, serialized (fp32 activations)
    prompts: list[list[int]]       # QUESTIONS through the file's chat template
    want: list[list[int]]          # transformers' greedy tokens, NEW_TOKENS per prompt


def transformers_model(loader):
    """transformers' fp32 model of the file (its GGUF loader dequantizes)."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(loader.path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def chat_prompts(tok, questions: list[str]) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    return_dict=True)["input_ids"] for q in questions]


def build_case(path: str, out_dir: str) -> SmolLM2Case:
    from helpers import hf_greedy

    from allspark_server import HuggingFaceModel
    loader = HuggingFaceModel(path, "smollm2", user_set_data_type="float32").load_model()
    loader.serialize(None, model_output_dir=out_dir)
    prompts = chat_prompts(loader.get_tokenizer(), QUESTIONS)
    reference = transformers_model(loader)
    want = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    del reference
    gc.collect()
    return SmolLM2Case(loader, prompts, want)
