"""A model folder's tokenizer: loaded through transformers (Qwen v1's tiktoken file and a GGUF file's vocabulary by
our own readers), and as tokenizer.json text for guided output."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("allspark")


def read_tokenizer_json(path: str, trust_remote_code: bool = False) -> str:
    """The folder's tokenizer as tokenizer.json text: the file itself, else the fast tokenizer transformers
    builds from the folder's other tokenizer files, else "" (no tokenizer: guided output is unavailable)."""
    file = os.path.join(path, "tokenizer.json")
    try:
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                return f.read()
        tok = load_tokenizer(path, trust_remote_code, use_fast=True)
        backend = getattr(tok, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else ""
    except Exception as e:   # no (usable) tokenizer files: not an error, the model still serves ids
        log.info("no fast tokenizer in %s (%s): guided output will be unavailable", path, e)
        return ""


def load_tokenizer(path: str, trust_remote_code: bool = False, **kwargs):
    """The folder's tokenizer through transformers; a Qwen v1 folder's tiktoken file is read by our own reader
    (loader/qwen_tokenizer.py) unless the caller asked for the remote code; a GGUF file's from its metadata."""
    from allspark_server.loader import qwen_tokenizer
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from allspark_server.loader.gguf_model import load_gguf_tokenizer
        return load_gguf_tokenizer(path, **kwargs)
    if not trust_remote_code and qwen_tokenizer.is_qwen_tiktoken_folder(path):
        return qwen_tokenizer.load_qwen_tokenizer(path, kwargs.get("padding_side", "left"))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
