"""The SmolLM2 file's test case, built once per session for the Engine test (test_gguf_smollm2.py) and the pool
test (test_smollm2_serve.py): the file serialized by our loader (its Q4_1 weights kept as uint4_min), 8 chat
prompts, and transformers' fp32 greedy tokens for them (its GGUF loader dequantizes the same file). Loading
transformers' model of the file and generating 8 x 32 tokens with it (as one batch) is the slow part; both tests
check against the same reference."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
from dataclasses import dataclass
from unittest import mock

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


@contextlib.contextmanager
def one_read_of_each_file():
    """Meanwhile gguf's reader is built once per file and its tensor name map once per architecture: transformers'
    GGUF loader reads the file's metadata (SmolLM2's 49k-token vocabulary) twice, once for the config and once for
    the weights, and builds the name map again for every submodule; both are read-only, so the model is the same."""
    import gguf
    readers: dict = {}
    real_reader = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (os.path.abspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]
    with (mock.patch.object(gguf, "GGUFReader", reader),
          mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map))):
        yield


def transformers_model(loader):
    """transformers' fp32 model of the file (its GGUF loader dequantizes)."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(loader.path)
    with one_read_of_each_file():
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def chat_prompts(tok, questions: list[str]) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    return_dict=True)["input_ids"] for q in questions]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for every prompt, as one left-padded batch: one pass over the weights a step
    serves all of them, and the tokens are those of each prompt alone (a row attends to its own positions only; the
    padding is masked and its positions are counted from the first real token)."""
    width = max(map(len, prompts))
    x = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[:, width:].tolist()


def build_case(path: str, out_dir: str) -> SmolLM2Case:
    from allspark_server import HuggingFaceModel
    loader = HuggingFaceModel(path, "smollm2", user_set_data_type="float32").load_model()
    loader.serialize(None, model_output_dir=out_dir)
    prompts = chat_prompts(loader.get_tokenizer(), QUESTIONS)
    reference = transformers_model(loader)
    want = hf_greedy_batch(reference, prompts, NEW_TOKENS)
    del reference
    gc.collect()
    return SmolLM2Case(loader, prompts, want)
