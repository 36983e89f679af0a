"""Qwen v1's tokenizer read from its `qwen.tiktoken` without remote code (loader/qwen_tokenizer.py), against the
`tiktoken` package on the same file (what Qwen's own QWenTokenizer runs): ids and text equal on awkward input,
ChatML as Qwen-Chat's make_context writes it (hand-written below), chat stop ids, and a Qwen v1 folder served by
allspark-serve to the `openai` client with no trust_remote_code anywhere."""
from __future__ import annotations

import base64
import json
import os
import unicodedata

import pytest
import tiktoken
from helpers import greedy, serialize, start_engine
from http_helpers import Server
from remote_layouts import write_qwen1
from safetensors.torch import load_file, save_file
from tiktoken._educational import bpe_train

from allspark_server.loader import qwen_tokenizer as qt
from allspark_server.loader.tiny_model import build_tiny_model

CORPUS = ("The quick brown fox jumps over the lazy dog. I'm sure they've said it's 12345 times; we'll see.\n"
          "def main():\n    return 42\n\n你好，世界！通义千问是一个大语言模型。 Zürich naïve café — 2024-11-23.\n") * 4
MERGES = 40            # 256 byte tokens + 40 merges + 208 specials = 504 ids, within the tiny model's 512
TEXTS = ["Hello world", "I'm here, they're not; it'd be 1234567 dogs.", "  leading and   inner   spaces\n\n\tx",
         "你好，世界！", "emoji 🦊🚀 and ZWJ 👩‍👩‍👧", "caf\u0065\u0301 (decomposed) vs caf\u00e9",
         "line\r\nbreaks\n\n\n", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<|extra_7|>text<|extra_204|>", "",
         "x" * 300]


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return bpe_train(CORPUS, 256 + MERGES, qt.SPLIT_PATTERN, visualise=None)


@pytest.fixture(scope="module")
def reference(ranks) -> tiktoken.Encoding:
    """tiktoken over the same ranks, Qwen's pattern and special tokens numbered after the ranks."""
    return tiktoken.Encoding("qwen-tiny", pat_str=qt.SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(qt.SPECIAL_TOKENS)})


def write_tiktoken(ranks: dict[bytes, int], folder: str) -> None:
    with open(os.path.join(folder, qt.TIKTOKEN_FILE), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")


@pytest.fixture(scope="module")
def qwen_folder(ranks, tmp_path_factory) -> str:
    """A Qwen v1 remote-code folder (tests/remote_layouts.py) with the trained qwen.tiktoken and Qwen-Chat's
    generation_config keys."""
    src = str(tmp_path_factory.mktemp("qwen2_src"))
    build_tiny_model(src, "qwen2_mha", seed=3, weight_scale=0.08, tokenizer=False)
    weights = os.path.join(src, "model.safetensors")
    tensors = load_file(weights)
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    for token, rank in ranks.items():   # logits 0 for tokens that are no whole UTF-8 text, and for the specials:
        try:                            # greedy output is then readable text
            token.decode("utf-8")
        except UnicodeDecodeError:
            tensors[head][rank] = 0
    tensors[head][len(ranks):] = 0
    save_file(tensors, weights, metadata={"format": "pt"})
    folder = write_qwen1(src, str(tmp_path_factory.mktemp("qwen1")))
    write_tiktoken(ranks, folder)
    path = os.path.join(folder, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen.update(chat_format="chatml", eos_token_id=len(ranks))     # <|endoftext|>, as Qwen-7B-Chat's
    with open(path, "w") as f:
        json.dump(gen, f)
    return folder


def test_ids_and_text_equal_tiktoken(qwen_folder, reference):
    tok = qt.load_qwen_tokenizer(qwen_folder)
    for text in TEXTS:
        want = reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")   # QWenTokenizer: NFC first
        got = tok(text, add_special_tokens=False)["input_ids"]
        assert got == want, text
        assert tok.decode(got) == reference.decode(want)
    assert len(tok) == reference.n_vocab


def test_special_ids_follow_the_ranks(qwen_folder, ranks):
    ids = qt.special_token_ids(qwen_folder)
    assert ids[qt.ENDOFTEXT] == len(ranks) and ids[qt.IM_END] == len(ranks) + 2
    assert ids["<|extra_204|>"] == len(ranks) + 207
    tok = qt.load_qwen_tokenizer(qwen_folder)
    assert tok.convert_tokens_to_ids([qt.IM_START, "<|extra_0|>"]) == [len(ranks) + 1, len(ranks) + 3]


def test_chat_template_is_qwen_chatml(qwen_folder):
    tok = qt.load_qwen_tokenizer(qwen_folder)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "2+2?"}]
    # Qwen-Chat's make_context: system block first (its default prompt), blocks joined by "\n"
    assert tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert tok.apply_chat_template(own, tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx<|im_end|>")


def test_the_loader_reads_it_without_remote_code(qwen_folder, ranks, tmp_path):
    loader = serialize(qwen_folder, "qwen1", str(tmp_path))
    assert loader.trust_remote_code is False
    assert loader.eos_token_ids() == [len(ranks), len(ranks) + 2, len(ranks) + 1]   # endoftext, im_end, im_start
    assert loader.get_tokenizer()("你好")["input_ids"] == qt.load_qwen_tokenizer(qwen_folder)("你好")["input_ids"]
    from allspark_server.loader.model_file import read_model_graph  # guided output's vocabulary
    assert json.loads(read_model_graph(loader.graph_path, loader.weights_path).tokenizer_json)["model"]["type"] == "BPE"


def test_allspark_serve_chats_with_a_qwen1_folder(qwen_folder, ranks, reference, tmp_path):
    """The chat endpoint renders ChatML, generates, and detokenizes: equal to the Engine's greedy tokens on
    tiktoken's encoding of the hand-written ChatML prompt, up to the first stop id, decoded by tiktoken without
    the special tokens (the server skips them in text, as vLLM does)."""
    import openai
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "Tell me about Zürich.<|im_end|>\n<|im_start|>assistant\n")
    ids = reference.encode(prompt, allowed_special="all")
    loader = serialize(qwen_folder, "qwen1", str(tmp_path))
    engine = start_engine(loader, "qwen1")
    try:
        want = greedy(engine, "qwen1", ids, 12)        # ignores EOS: a tiny random model, 12 tokens whatever
    finally:
        engine.shutdown()
    stops = set(loader.eos_token_ids())
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    server = Server(qwen_folder, name="qwen1")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="qwen1",
                                           messages=[{"role": "user", "content": "Tell me about Zürich."}],
                                           max_tokens=12, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert sum(t < len(ranks) for t in want) >= 6          # mostly text, so the comparison says something
        assert r.choices[0].message.content == reference.decode([t for t in want[:cut] if t < len(ranks)])
        assert r.choices[0].finish_reason == ("stop" if cut < len(want) else "length")
    finally:
        server.stop()
