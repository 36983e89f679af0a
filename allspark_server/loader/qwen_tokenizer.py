"""Qwen v1's tokenizer without its remote code.

A Qwen (v1) folder ships `qwen.tiktoken` (one `<base64 of the token's bytes> <rank>` line per byte-level BPE token)
and a tokenizer class that needs `tiktoken` and `trust_remote_code`. Here the file is read into a transformers fast
tokenizer instead, through transformers' own tiktoken converter (the ranks become a tokenizers byte-level BPE):
Qwen's split pattern (single digits), NFC normalization of the input text, and its special tokens numbered after
the BPE ranks in Qwen's order (<|endoftext|>, <|im_start|>, <|im_end|>, <|extra_0|> .. <|extra_204|>). Qwen-Chat
talks ChatML; its folders carry no chat template (the remote code's `chat()` builds the prompt), so the tokenizer
gets that format as its template, system prompt included, and a chatml generation config stops at <|im_end|> and
<|im_start|> as `chat()` does. Tested against `tiktoken` on the same file (tests/models/test_qwen_tokenizer.py).
"""
from __future__ import annotations

import base64
import os

TIKTOKEN_FILE = "qwen.tiktoken"
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END) + tuple(f"<|extra_{i}|>" for i in range(205))
DEFAULT_SYSTEM = "You are a helpful assistant."
# ChatML as Qwen-Chat's make_context writes it: blocks joined by one newline, a default system prompt. The
# newlines are expressions: transformers renders templates with trim_blocks, which drops one after a tag.
CHATML_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '" + DEFAULT_SYSTEM + "' -%}{%- set turns = messages -%}{%- endif -%}"
    "{{ '<|im_start|>system\\n' + system + '<|im_end|>' }}"
    "{%- for m in turns -%}{{ '\\n<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n<|im_start|>assistant\\n' }}{%- endif -%}")


def is_qwen_tiktoken_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TIKTOKEN_FILE))


def read_ranks(path: str) -> dict[bytes, int]:
    """`<base64 token> <rank>` per line -> {token bytes: rank}; a malformed line is reported by number."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}: line {n} is not '<base64 token> <rank>': {e}") from None
    return ranks


def special_token_ids(folder: str) -> dict[str, int]:
    """Numbered after the ranks: counting the file's lines is enough (no base64 decoding of ~150k tokens)."""
    with open(os.path.join(folder, TIKTOKEN_FILE), "rb") as f:
        n = sum(1 for line in f if line.strip())
    return {tok: n + i for i, tok in enumerate(SPECIAL_TOKENS)}


def chatml_stop_ids(folder: str, generation_config: dict) -> list[int]:
    """The ids Qwen-Chat's chat() stops at, for a folder whose generation_config.json says chat_format chatml."""
    if generation_config.get("chat_format") != "chatml" or not is_qwen_tiktoken_folder(folder):
        return []
    ids = special_token_ids(folder)
    return [ids[IM_END], ids[IM_START]]


def load_qwen_tokenizer(folder: str, padding_side: str = "left"):
    """A PreTrainedTokenizerFast equivalent to the folder's QWenTokenizer."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = os.path.join(folder, TIKTOKEN_FILE)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:   # without the tiktoken package
            return read_ranks(tiktoken_url)

    backend = _Converter(path, pattern=SPLIT_PATTERN, extra_special_tokens=list(SPECIAL_TOKENS)).converted()
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
                                  padding_side=padding_side, clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML_TEMPLATE
    return tok
