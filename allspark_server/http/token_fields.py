"""The sampling fields of chat and completions requests that name token ids: OpenAI's `logit_bias` (an object whose
keys are token ids written as strings) and vLLM's `stop_token_ids` (a list of ints), checked for shape here and
turned into the allspark generation config's `logit_bias` and `stop_words_ids`.

Whether an id is in the vocabulary and a bias in [-100, 100] is the engine's check (its PARAM_ERROR names
logit_bias / stop_words_ids, which protocol.error_from_engine turns into a 400 naming the OpenAI field). A bad shape
raises TokenFieldError, which protocol.py answers with a 400 naming the field.
"""
from __future__ import annotations

import re
from typing import Any

MAX_STOP_TOKEN_IDS = 64
_ID = re.compile(r"\s*[0-9]{1,19}\s*")


class TokenFieldError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def parse_logit_bias(value: dict) -> dict[int, float]:
    """OpenAI's {"<token id>": bias} -> {id: bias} (ids as OpenAI writes them, JSON object keys being strings)."""
    out = {}
    for key, bias in value.items():
        if not _ID.fullmatch(str(key)):
            raise TokenFieldError(f"Invalid key in 'logit_bias': {key!r:.40} is not a token id (the keys are token "
                                  f"ids written as strings, e.g. {{\"50256\": -100}})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise TokenFieldError(f"Invalid value in 'logit_bias' for token {key}: expected a number in "
                                  f"[-100, 100], got {bias!r:.40}", "logit_bias")
        out[int(key)] = bias
    return out


def parse_stop_token_ids(value: Any) -> tuple[int, ...]:
    """vLLM's stop_token_ids: the distinct token ids (at most MAX_STOP_TOKEN_IDS) whose generation ends the output."""
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise TokenFieldError(f"'stop_token_ids' must be an array of token ids (integers >= 0), got "
                              f"{value!r:.80}", "stop_token_ids")
    ids = tuple(dict.fromkeys(value))
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise TokenFieldError(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}",
                              "stop_token_ids")
    return ids


def stop_words_of(stop_token_ids: tuple[int, ...]) -> list[list[int]]:
    """The engine's stop_words_ids for stop_token_ids: one single-token stop word each."""
    return [[t] for t in stop_token_ids]
