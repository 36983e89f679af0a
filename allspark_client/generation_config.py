"""Generation (sampling) config: validation of a request's dict into a frozen GenerationConfig,
prompt ids, the length limit, and DashInfer's ASGenerationConfigBuilder.

Torch-free, shared by Engine and ClientEngine so both reject the same things with the same
messages. Nothing is silently rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from allspark_client.image_inputs import IMAGE_KEYS
from allspark_client.response_format import ResponseFormat, parse_response_format
from allspark_client.types import AsStatus
from allspark_client.validation import ConfigError, _check, _float, _int, _is_int, _token_list

MAX_TOP_LOGPROBS = 10
MAX_LOGIT_BIAS = 300       # logit_bias entries a request may carry (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0   # each bias in [-100, 100]
INT64_MAX = 2**63 - 1   # integers travel as int64 to a pool


@dataclass(frozen=True)
class GenerationConfig:
    """One request's sampling parameters after validation. `None` max_length = engine_max_length."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 0
    max_length: Optional[int] = None
    max_new_tokens: Optional[int] = None
    eos_token_ids: Optional[tuple[int, ...]] = None   # None: the model's own EOS ids
    stop_words_ids: tuple[tuple[int, ...], ...] = ()
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    do_sample: bool = True
    response_format: Optional[ResponseFormat] = None   # None: plain text; otherwise guided output
    speculative: bool = True                # False: no speculative decoding for this request (the model's config)
    lora_name: Optional[str] = None         # the LoRA adapter the request runs with; None: the base model
    # vLLM's: None off; k >= 0: each prompt token's logprob (position 0 has none) and the top k at each position
    prompt_logprobs: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit), ids ascending

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):   # built directly with a dict: the same pairs, by id
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    @property
    def is_greedy(self) -> bool:
        return (not self.do_sample) or self.top_k == 1 or self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# DashInfer keys we accept for compatibility; each only with the value(s) that mean "off".
_INERT_KEYS = {
    "num_beams": (1,), "num_return_sequences": (1,), "length_penalty": None, "early_stopping": None,
    "no_repeat_ngram_size": (0,), "bad_words_ids": ([],), "uuid": None, "input_len": None,
    "vocab": None, "vocab_type": None, "enable_tensors_from_model_inference": (False,),
    "suppress_repetition_in_generation": (False,), "mm_info": (None,),
}
_KNOWN_KEYS = set(GenerationConfig.__dataclass_fields__) - {"eos_token_ids"} | {"eos_token_id"}


def parse_generation_config(raw: Optional[dict], vocab_size: Optional[int] = None) -> GenerationConfig:
    """Validate a user dict into a GenerationConfig; raise ConfigError naming the offending key.

    Keys absent from `raw` take the defaults above (eos_token_id absent stays None: the engine
    uses the model's own). Token ids are checked against `vocab_size` when it is known (the server;
    a client checks everything else). Nothing is silently rewritten.
    """
    if raw is None:
        raw = {}
    _check(isinstance(raw, dict), f"generation config must be a dict, got {type(raw).__name__}")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        _check(isinstance(key, str), f"generation config keys must be strings, got {key!r}")
        if key in _INERT_KEYS:
            allowed = _INERT_KEYS[key]
            _check(allowed is None or any(type(value) is type(a) and value == a for a in allowed),
                   f"{key}={value!r} is not supported (allowed: {allowed})")
            continue
        _check(key in _KNOWN_KEYS, f"unknown generation config key {key!r}")
        kw[key] = value

    out: dict[str, Any] = {}
    if "temperature" in kw:
        out["temperature"] = _float("temperature", kw["temperature"], lo=0.0, hi=100.0)
    if "top_k" in kw:
        out["top_k"] = _int("top_k", kw["top_k"], lo=0, hi=INT64_MAX)
    if "top_p" in kw:
        p = _float("top_p", kw["top_p"], lo=0.0, hi=1.0)
        _check(p > 0.0, "top_p must be in (0, 1]; 1.0 disables it")
        out["top_p"] = p
    if "repetition_penalty" in kw:
        r = _float("repetition_penalty", kw["repetition_penalty"], lo=0.0, hi=2.0)
        _check(r > 0.0, "repetition_penalty must be in (0, 2]; 1.0 disables it")
        out["repetition_penalty"] = r
    for key in ("presence_penalty", "frequency_penalty"):
        if key in kw:
            out[key] = _float(key, kw[key], lo=-2.0, hi=2.0)
    if "min_length" in kw:
        out["min_length"] = _int("min_length", kw["min_length"], lo=0, hi=INT64_MAX)
    for key in ("max_length", "max_new_tokens"):
        if key in kw and kw[key] is not None:
            out[key] = _int(key, kw[key], lo=1, hi=INT64_MAX)
    if "eos_token_id" in kw:
        out["eos_token_ids"] = _token_list("eos_token_id", kw["eos_token_id"], vocab_size)
    if "stop_words_ids" in kw:
        words = kw["stop_words_ids"]
        _check(isinstance(words, (list, tuple)), "stop_words_ids must be a list of token-id lists")
        seqs = []
        for w in words:
            _check(isinstance(w, (list, tuple)) and len(w) > 0,
                   f"stop_words_ids entries must be non-empty lists of token ids, got {w!r}")
            seqs.append(_token_list("stop_words_ids", list(w), vocab_size))
        out["stop_words_ids"] = tuple(seqs)
    if "seed" in kw and kw["seed"] is not None:
        out["seed"] = _int("seed", kw["seed"], lo=0, hi=2**64 - 1)
    if "logprobs" in kw:
        _check(isinstance(kw["logprobs"], bool), f"logprobs must be a bool, got {kw['logprobs']!r}")
        out["logprobs"] = kw["logprobs"]
    if "top_logprobs" in kw:
        out["top_logprobs"] = _int("top_logprobs", kw["top_logprobs"], lo=0, hi=MAX_TOP_LOGPROBS)
    if "prompt_logprobs" in kw and kw["prompt_logprobs"] is not None:
        out["prompt_logprobs"] = _int("prompt_logprobs", kw["prompt_logprobs"], lo=0, hi=MAX_TOP_LOGPROBS)
    if "do_sample" in kw:
        _check(isinstance(kw["do_sample"], bool), f"do_sample must be a bool, got {kw['do_sample']!r}")
        out["do_sample"] = kw["do_sample"]
    if "speculative" in kw:
        _check(isinstance(kw["speculative"], bool), f"speculative must be a bool, got {kw['speculative']!r}")
        out["speculative"] = kw["speculative"]
    if "lora_name" in kw:
        name = kw["lora_name"]
        _check(name is None or isinstance(name, str), f"lora_name must be a string (a loaded LoRA adapter's name; "
               f"\"\" or None: the base model), got {type(name).__name__} {name!r:.80}")
        if name:      # "" and None both mean the base model
            out["lora_name"] = name
    if "logit_bias" in kw:
        out["logit_bias"] = _logit_bias(kw["logit_bias"], vocab_size)
    if "response_format" in kw:
        out["response_format"] = parse_response_format(kw["response_format"])
        _check(out["response_format"] is None or not out.get("min_length"),
               "min_length cannot be combined with response_format: the grammar decides where the output ends")
    return GenerationConfig(**out)


def _logit_bias(raw: Any, vocab_size: Optional[int]) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) -> (id, bias) pairs by id: at most MAX_LOGIT_BIAS ids of the
    vocabulary, each bias a number in [-100, 100]; None or {} -> ()."""
    if raw is None:
        return ()
    if isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        _check(isinstance(raw, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in raw),
               f"logit_bias must be a dict of token id -> bias, got {type(raw).__name__} {raw!r:.80}")
        pairs = [tuple(p) for p in raw]
    _check(len(pairs) <= MAX_LOGIT_BIAS, f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(pairs)}")
    out = {}
    for t, b in pairs:
        _check(_is_int(t) and 0 <= int(t) < (vocab_size or 2**63),
               f"logit_bias keys must be token ids in [0, {vocab_size or '2^63'}), got {t!r}")
        _check(int(t) not in out, f"logit_bias names token id {int(t)} twice")
        out[int(t)] = _float(f"logit_bias[{int(t)}]", b, lo=-LOGIT_BIAS_RANGE, hi=LOGIT_BIAS_RANGE)
    return tuple(sorted(out.items()))


def parse_input_ids(raw: Any, vocab_size: Optional[int] = None) -> list[int]:
    """input_ids as a torch tensor, numpy array, list or tuple, shaped [L] or [1, L] -> list[int].

    Raises ConfigError (EMPTY_REQUEST for an empty prompt, PARAM_ERROR otherwise). Torch-free:
    tensors and arrays are read through `.tolist()`.
    """
    if hasattr(raw, "tolist") and not isinstance(raw, list):
        raw = raw.tolist()
    if isinstance(raw, tuple):
        raw = list(raw)
    _check(isinstance(raw, list),
           f"input_ids must be a list, numpy array or torch tensor, got {type(raw).__name__}")
    if raw and isinstance(raw[0], (list, tuple)):
        _check(len(raw) == 1, f"input_ids holds a batch of {len(raw)}; start one request per prompt")
        raw = list(raw[0])
    _check(len(raw) > 0, "input_ids is empty", AsStatus.ALLSPARK_EMPTY_REQUEST)
    limit = vocab_size or 2**63
    for t in raw:
        _check(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < limit,
               f"input_ids must be token ids in [0, {vocab_size or '2^63'}), found {t!r}")
    return raw


def parse_request(inputs: Any, generate_config: Any, vocab_size: Optional[int] = None
                  ) -> tuple[list[int], dict, GenerationConfig]:
    """start_request's checks, shared by Engine and ClientEngine: `inputs` is {"input_ids": ...}
    (an attention_mask is tolerated), the config a dict or builder. Returns (ids, raw dict, config)."""
    _check(isinstance(inputs, dict) and "input_ids" in inputs, "inputs must be a dict with key 'input_ids'")
    extra = set(inputs) - {"input_ids", "attention_mask", *IMAGE_KEYS}
    _check(not extra, f"unknown inputs keys {sorted(extra)}")
    raw = generate_config.build() if isinstance(generate_config, ASGenerationConfigBuilder) else generate_config
    raw = {} if raw is None else raw
    ids = parse_input_ids(inputs["input_ids"], vocab_size)
    return ids, raw, parse_generation_config(raw, vocab_size)


def resolve_max_length(gen: GenerationConfig, prompt_len: int, engine_max_length: int) -> int:
    """Total length (prompt + output) the request may reach; ConfigError(EXCEED_LIMIT) if none left."""
    limit = engine_max_length if gen.max_length is None else gen.max_length
    if limit > engine_max_length:
        raise ConfigError(f"max_length {limit} exceeds engine_max_length {engine_max_length}",
                          AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR)
    if gen.max_new_tokens is not None:
        limit = min(limit, prompt_len + gen.max_new_tokens)
    if prompt_len >= limit:
        raise ConfigError(f"prompt of {prompt_len} tokens leaves no room to generate under "
                          f"max_length {limit}", AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR)
    return limit


class ASGenerationConfigBuilder:
    """Builds a generation-config dict (DashInfer's builder); `update()` is the main entry point."""

    def __init__(self, base: Optional[dict] = None):
        self._cfg: dict[str, Any] = dict(base or {})

    def update(self, d: dict):
        self._cfg.update(d)
        return self

    def do_sample(self, flag: bool = True):
        self._cfg["do_sample"] = flag
        return self

    def early_stopping(self, flag: bool = True):
        self._cfg["early_stopping"] = flag
        return self

    def log_probs(self, enable: bool, top_logprobs: int = 0):
        self._cfg.update(logprobs=enable, top_logprobs=top_logprobs)
        return self

    def build(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._cfg.items()}
