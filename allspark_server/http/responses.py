"""OpenAI response bodies: chat.completion / text_completion objects, their stream chunks, usage and logprobs.

Pure functions of what a request produced (text, finish reason, token ids with logprobs); no I/O, no engine.
Field names and shapes follow the OpenAI API reference, so the official `openai` client parses them.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from allspark_server.http.detokenize import TokenText


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]       # (token id, logprob), best first


def sse(obj) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Builds the bodies of one request (`kind` "chat" or "completion"): one id and creation time for all."""

    def __init__(self, kind: str, model: str, token_text: TokenText, top_logprobs: int, include_usage: bool = False):
        self.kind, self.model, self._text, self.top_n = kind, model, token_text, top_logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._include_usage = include_usage
        self._offset = 0               # completions' text_offset of the next token
        self.index = 0                 # the choice this builder's chunks and choice bodies belong to

    def for_choice(self, index: int) -> "ResponseBuilder":
        """A builder of the same response (id, creation time) for choice `index` (n > 1), with its own offsets."""
        other = copy.copy(self)
        other.index, other._offset = index, 0
        return other

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- logprobs ----------------------------------------------------------------------------
    def logprobs(self, tokens: list[TokenLogprob]) -> Optional[dict]:
        if self.kind == "chat":
            def entry(tid, lp):
                text, raw = self._text.get(tid)
                return {"token": text, "logprob": lp, "bytes": list(raw)}
            return {"content": [{**entry(t.token_id, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in t.top[:self.top_n]]} for t in tokens],
                    "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = self._text.get(t.token_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            top = {self._text.get(i)[0]: lp for i, lp in t.top[:self.top_n]}
            top.setdefault(text, t.logprob)        # the sampled token is always listed (as vLLM does)
            out["top_logprobs"].append(None if t.logprob is None else top)   # an echoed prompt's first: none
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    # ---- streaming ---------------------------------------------------------------------------
    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None,
              tokens: Optional[list[TokenLogprob]] = None, role: bool = False) -> dict:
        lp = self.logprobs(tokens) if tokens else None
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", **delta}
            choice = {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if self._include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    # ---- whole response ----------------------------------------------------------------------
    def choice(self, text: str, finish_reason: str, tokens: Optional[list[TokenLogprob]]) -> dict:
        """This builder's choice of a whole (non-streamed) response."""
        lp = self.logprobs(tokens) if tokens is not None else None
        if self.kind == "chat":
            return {"index": self.index, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": lp, "finish_reason": finish_reason}
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def body(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole response: its choices (each from `choice`), usage counting the prompt once."""
        head = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        return {**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def full(self, text: str, finish_reason: str, tokens: Optional[list[TokenLogprob]], prompt_tokens: int,
             completion_tokens: int) -> dict:
        return self.body([self.choice(text, finish_reason, tokens)], prompt_tokens, completion_tokens)
