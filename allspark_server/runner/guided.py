"""Guided output (`response_format`) on rank 0, built on llguidance.

llguidance compiles JSON schemas, regexes and Lark grammars against the model's tokenizer and computes the
next-token mask of each request in Rust (GIL released, in parallel over requests). Here:
`GuidedVocabulary` (one per served model: the tokenizer, compiled grammars, mask computation),
`GuidedState` (one per guided request: where its output is in the grammar) and `apply_masks` (sets the
disallowed tokens of the guided rows of a logits batch to -inf).

One step of a batch with guided rows: `future = vocab.start_masks(states)` before the model step runs,
`bitmask = future.result()` after it, `apply_masks(logits, rows, bitmask)`, sample, then
`state.accept(token)` for each guided row. A state must not be touched while its masks are computing.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from allspark_client.response_format import ResponseFormat
from allspark_client.types import AsStatus
from allspark_client.validation import ConfigError
from allspark_server.compute.device_kind import in_host_memory

# JSON output is written like Python's json.dumps: ", " and ": " and no other whitespace, so a model cannot
# loop on whitespace. A schema may override this with llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
MAX_ERROR_CHARS = 600


def _limits():
    import llguidance
    return llguidance.LLParserLimits(verbose_errors=False)


class GuidedState:
    """One guided request's position in its grammar (an llguidance LLMatcher).

    `is_stopped`: nothing but EOS may follow: the grammar admits no more text, or EOS was consumed, or the
    state is in error; the request should end now. `is_accepting`: the output so far is complete (the mask
    allows EOS), though it may go on. `is_error`: a token the mask forbade was consumed or a parser limit
    was hit; `error` says which.
    """
    __slots__ = ("fmt", "matcher", "num_tokens")

    def __init__(self, fmt: ResponseFormat, matcher):
        self.fmt = fmt
        self.matcher = matcher
        self.num_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False: the matcher is (now) in its error state."""
        self.num_tokens += 1
        return self.matcher.consume_token(int(token_id))

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()[:MAX_ERROR_CHARS]

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def stop_reason(self) -> str:
        return self.matcher.stop_reason()


class GuidedVocabulary:
    """A model's tokenizer as llguidance sees it, its compiled grammars (LRU) and the mask computation.

    `tokenizer_json` is the HF tokenizer.json text (ModelFile.tokenizer_json); `vocab_size` the model's
    (its logits width; may exceed the tokenizer's); `eos_token_ids` the model's EOS ids, the tokens a
    finished grammar allows. Raises ValueError when the tokenizer cannot be used.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: Optional[int] = None, cache_size: int = 256):
        import llguidance
        import llguidance.hf
        import tokenizers
        from transformers import PreTrainedTokenizerFast

        if not tokenizer_json:
            raise ValueError("the model has no tokenizer (serialize it from a folder with tokenizer.json)")
        backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.tokenizer_vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.vocab_size = int(vocab_size)
        self.num_bits = max(self.vocab_size, self.tokenizer_vocab_size)   # llguidance's n_vocab
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids if 0 <= int(t) < self.vocab_size)
        if not self.eos_token_ids:
            raise ValueError(f"guided output needs the model's EOS token ids (got {list(eos_token_ids)})")
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.num_bits, eos_token=list(self.eos_token_ids))
        self.words = (self.num_bits + 31) // 32                  # int32 words per bitmask row
        # tokens the model and the tokenizer both know, and EOS: everything else is always disallowed
        keep = np.zeros(self.words * 32, dtype=np.uint8)
        keep[:min(self.vocab_size, self.tokenizer_vocab_size)] = 1
        keep[list(self.eos_token_ids)] = 1
        self._keep = np.packbits(keep, bitorder="little").view(np.int32)
        self._executor = llguidance.LLExecutor(num_threads)
        self._cache: OrderedDict[ResponseFormat, tuple[str, object]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._worker: Optional[ThreadPoolExecutor] = None

    # ---- grammars ----------------------------------------------------------------------------------
    def _grammar(self, fmt: ResponseFormat) -> str:
        from llguidance import LLMatcher
        if fmt.kind in ("json_object", "json_schema"):
            schema = ANY_OBJECT if fmt.kind == "json_object" else fmt.spec
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise ConfigError(f"response_format json_schema is invalid: {e}",
                                  AsStatus.ALLSPARK_PARAM_ERROR) from None
        if fmt.kind == "regex":
            return LLMatcher.grammar_from_regex(fmt.spec)
        if fmt.kind == "lark":
            return LLMatcher.grammar_from_lark(fmt.spec)
        raise ConfigError(f"response_format type {fmt.kind!r} is unknown", AsStatus.ALLSPARK_PARAM_ERROR)

    def _compiled(self, fmt: ResponseFormat) -> tuple[str, object]:
        """(grammar, a matcher in its initial state to copy), compiled once per format."""
        from llguidance import LLMatcher
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.move_to_end(fmt)
                return hit
        grammar = self._grammar(fmt)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=_limits())
        if is_error:
            what = {"json_object": "json_schema", "json_schema": "json_schema"}.get(fmt.kind, fmt.kind)
            raise ConfigError(f"response_format {what} is invalid: {messages[0][:MAX_ERROR_CHARS].strip()}",
                              AsStatus.ALLSPARK_PARAM_ERROR)
        template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise ConfigError(f"response_format cannot be compiled: {template.get_error()[:MAX_ERROR_CHARS]}",
                              AsStatus.ALLSPARK_PARAM_ERROR)
        with self._lock:
            self._cache[fmt] = (grammar, template)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar, template

    def compile(self, fmt: ResponseFormat) -> str:
        """The llguidance grammar of a format (cached); ConfigError(PARAM_ERROR) naming what is wrong."""
        return self._compiled(fmt)[0]

    def new_state(self, fmt: ResponseFormat) -> GuidedState:
        """A fresh GuidedState at the start of the grammar (compiles it if needed: may raise ConfigError)."""
        return GuidedState(fmt, self._compiled(fmt)[1].deep_copy())

    # ---- masks -------------------------------------------------------------------------------------
    def allocate_bitmask(self, n: int) -> np.ndarray:
        """[n, words] int32, one bit per token (bit t % 32 of word t // 32), all allowed."""
        return np.full((n, self.words), -1, dtype=np.int32)

    def fill_masks(self, states: Sequence[GuidedState], bitmask: Optional[np.ndarray] = None) -> np.ndarray:
        """Row i of `bitmask` = the allowed next tokens of states[i] (computed in parallel, GIL released)."""
        from llguidance.numpy import fill_next_token_bitmask_par
        if bitmask is None:
            bitmask = self.allocate_bitmask(len(states))
        assert bitmask.shape[0] >= len(states) and bitmask.shape[1] == self.words, bitmask.shape
        if states:
            fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
            bitmask[:len(states)] &= self._keep
        return bitmask

    def start_masks(self, states: Sequence[GuidedState]) -> "Future[np.ndarray]":
        """Start fill_masks on the background thread; `.result()` gives the [len(states), words] bitmask.
        The states must not be used (accept) until then."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allspark-guided")
        return self._worker.submit(self.fill_masks, list(states))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


_NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))   # -inf as an int32 bit pattern


def _unpack_bits(bitmask: np.ndarray, device: torch.device) -> torch.Tensor:
    """[n, words] int32 -> [n, words * 32] uint8 0/1 on `device` (bit t % 32 of word t // 32 is token t)."""
    if in_host_memory(device):
        le = np.ascontiguousarray(bitmask, dtype="<i4")
        return torch.from_numpy(np.unpackbits(le.view(np.uint8), axis=1, bitorder="little"))
    bm = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32)).to(device)   # 1/32 of the mask's size
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((bm.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(bm.shape[0], -1)


def _fit(t: torch.Tensor, vocab_size: int, fill) -> torch.Tensor:
    """Cut or pad (with `fill`) the columns of [n, W] to vocab_size."""
    if t.shape[1] >= vocab_size:
        return t[:, :vocab_size]
    return torch.nn.functional.pad(t, (0, vocab_size - t.shape[1]), value=fill)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int, device=None) -> torch.Tensor:
    """[n, words] int32 bitmask -> [n, vocab_size] bool (True = allowed; columns past the bitmask: False)."""
    return _fit(_unpack_bits(bitmask, torch.device(device or "cpu")).bool(), vocab_size, False)


def apply_masks(logits: torch.Tensor, row_index: Sequence[int], bitmask: np.ndarray) -> torch.Tensor:
    """Set the disallowed tokens of rows `row_index` of `logits` [N, V] to -inf, in place; bitmask row i
    belongs to logits row row_index[i], tokens past the bitmask are disallowed. Returns `logits`.

    fp32 logits get an additive bias of 0 / -inf built from the bits with integer ops (branch-free, where a
    masked_fill over a large vocab is far slower on CPU: docs/performance.md, "Choices in the code"); a +inf logit on a
    disallowed token would become NaN.
    """
    n = len(row_index)
    if n == 0:
        return logits
    v = logits.shape[1]
    bits = _unpack_bits(bitmask[:n], logits.device)
    rows = list(row_index)
    contiguous = rows == list(range(rows[0], rows[0] + n))
    if logits.dtype == torch.float32:
        bias = _fit(bits.to(torch.int32).sub_(1).bitwise_and_(_NEG_INF_BITS).view(torch.float32), v, float("-inf"))
        if contiguous:
            logits[rows[0]:rows[0] + n].add_(bias)
        else:
            logits.index_add_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), bias)
        return logits
    disallowed = _fit(bits == 0, v, True)
    if contiguous:
        logits[rows[0]:rows[0] + n].masked_fill_(disallowed, float("-inf"))
    else:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits
