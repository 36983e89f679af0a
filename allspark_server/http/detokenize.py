"""Incremental detokenization and stop strings, per stream, on the HTTP server's event loop (never the engine's
thread).

IncrementalDetokenizer turns token ids into text as they arrive without ever emitting a broken character: it
decodes a short window of recent tokens twice (before and after the new ones) and emits only the new, complete
text, holding back a trailing U+FFFD (an incomplete UTF-8 sequence of byte-level BPE or byte-fallback tokens)
until the next token completes it: at most the last three (an incomplete character has at most three bytes, and
byte-fallback decoders write one U+FFFD per byte), so a run of bytes that can never form a character streams.
StopMatcher cuts the text at the first stop string and holds back any tail that could still become one, so no partial
stop string reaches a stream. TokenText gives each token's text and bytes for logprobs.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable, Optional

REPLACEMENT = "\ufffd"
MAX_INCOMPLETE = 3    # bytes of an incomplete UTF-8 character, each at most one trailing U+FFFD
PROMPT_CONTEXT = 6    # prompt tokens decoded before the output, so the first token's leading space is right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Iterable[int] = (), skip_ids: Iterable[int] = (),
                 keep_special: bool = False):
        """`keep_special`: special tokens are text too (tool-call markers), but for `skip_ids`."""
        self._tokenizer = tokenizer
        self._skip = frozenset(skip_ids)
        self._skip_special = not keep_special
        self._ids = [i for i in list(prompt_ids)[-PROMPT_CONTEXT:] if i not in self._skip]
        self._prefix = 0                 # the window starts here
        self._read = len(self._ids)      # text up to here has been emitted
        self._sent = 0                   # characters after `_read`'s text already emitted (before an incomplete one)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

    def add(self, ids: Iterable[int]) -> str:
        """Append generated ids; return the new text that is complete (may be "")."""
        self._ids.extend(i for i in ids if i not in self._skip)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the output: whatever is left, a trailing U+FFFD included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        new = self._decode(self._ids[self._prefix:])[len(before):]
        complete = new if final else _without_incomplete_tail(new)
        out = complete[self._sent:]
        if complete == new:     # no incomplete character left: the next window starts where this one's text ends
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        else:                   # hold back the trailing U+FFFD; what precedes it is final and already sent
            self._sent = max(self._sent, len(complete))
        return out


def _without_incomplete_tail(text: str) -> str:
    held = min(MAX_INCOMPLETE, len(text) - len(text.rstrip(REPLACEMENT)))
    return text[:len(text) - held]


class StopMatcher:
    """Cuts a stream of text at the earliest occurrence of any stop string (OpenAI `stop`: excluded from the
    output). `feed` returns (text safe to emit, whether a stop string matched)."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(stops)
        self._held = ""
        self.matched = False
        self.matched_stop: Optional[str] = None     # the stop string that cut the text (the earliest one)

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops or self.matched:
            return ("" if self.matched else text), self.matched
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched_stop = min(hits, key=lambda hit: hit[0])
            self._held, self.matched = "", True
            return buf[:at], True
        keep = 0     # the longest tail of buf that is the start of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched else held


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map, inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """The text and UTF-8 bytes of single tokens (logprobs' `token` and `bytes`), cached per token id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_map = _byte_level_decoder() if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.get = lru_cache(maxsize=65536)(self._get)

    def _get(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        if token_id in self._special:
            return piece, piece.encode()
        if self._byte_level and all(c in self._byte_map for c in piece):
            raw = bytes(self._byte_map[c] for c in piece)
        elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        elif "\u2581" in piece:       # sentencepiece: "▁" is a space
            raw = piece.replace("\u2581", " ").encode()
        else:
            raw = self._tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
        return raw.decode("utf-8", errors="replace"), raw
