"""Guided output's building blocks, without an engine: response_format parsing and its trip through the
proto, llguidance grammars and masks on the tiny locally trained tokenizer (random walks over every schema of
json_schemas.py must end in JSON that validates), apply_masks against a plain loop, and the tokenizer that
serialization stores in the model file."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import numpy as np
import pytest
import torch
from json_schemas import SCHEMAS

from allspark_client import AsStatus
from allspark_client.generation_config import parse_generation_config
from allspark_client.response_format import ResponseFormat, parse_response_format
from allspark_client.validation import ConfigError
from allspark_client.wire import generation_config_from_proto, generation_config_to_proto
from allspark_server.loader.tiny_model import VOCAB_SIZE, build_tiny_model, build_tokenizer
from allspark_server.runner.guided import GuidedVocabulary, apply_masks, unpack_bitmask

EOS = 1                 # the tiny models' eos_token_id ("</s>")
MAX_TOKENS = 200
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------------------------
# response_format parsing (torch-free client side)
# ------------------------------------------------------------------------------------------------

def _spec(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


ACCEPTED = [
    (None, None),
    ({}, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, ResponseFormat("json_object", "")),
    ({"type": "json_object", "json_schema": PERSON}, ResponseFormat("json_schema", _spec(PERSON))),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
     ResponseFormat("json_schema", _spec(PERSON))),
    ({"type": "json_schema", "json_schema": PERSON}, ResponseFormat("json_schema", _spec(PERSON))),
    ({"type": "json_schema", "json_schema": json.dumps(PERSON, indent=2)},
     ResponseFormat("json_schema", _spec(PERSON))),
    # a "schema" key without "name" is not OpenAI's wrapper: the dict is the schema itself
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
     ResponseFormat("json_schema", '{"schema":{"type":"object"}}')),
    ({"type": "regex", "regex": "[a-z]+"}, ResponseFormat("regex", "[a-z]+")),
    ({"type": "lark", "lark": 'start: "a"'}, ResponseFormat("lark", 'start: "a"')),
]


@pytest.mark.parametrize("raw,expected", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_response_format_accepted(raw, expected):
    fmt = parse_response_format(raw)
    assert fmt == expected
    if fmt is not None:
        assert ResponseFormat.from_json(fmt.to_json()) == fmt
        assert parse_response_format(fmt.to_dict()) == fmt
    # through the generation config and the pool's proto, both ways
    gen = parse_generation_config({"response_format": raw, "top_k": 1})
    assert gen.response_format == expected
    back = generation_config_from_proto(generation_config_to_proto({"response_format": raw, "top_k": 1}, gen))
    assert parse_generation_config(back).response_format == expected


def test_schema_keeps_property_order():
    """Properties are generated in the schema's order, so the canonical text keeps it (no sort_keys)."""
    a = parse_response_format({"type": "json_schema", "json_schema": {"properties": {"b": {}, "a": {}}}})
    assert a.spec == '{"properties":{"b":{},"a":{}}}'


REJECTED = [
    ("not_a_dict", "json_object", "must be a dict"),
    ("no_type", {"json_schema": PERSON}, "'type'"),
    ("unknown_type", {"type": "xml"}, "'xml' is unknown"),
    ("type_not_str", {"type": 3}, "is unknown"),
    ("json_schema_missing", {"type": "json_schema"}, "needs a 'json_schema' key"),
    ("schema_bad_string", {"type": "json_schema", "json_schema": "{bad"}, "not valid JSON"),
    ("schema_not_object", {"type": "json_schema", "json_schema": [1, 2]}, "must be a JSON object"),
    ("schema_string_not_object", {"type": "json_schema", "json_schema": "[1]"}, "must be a JSON object"),
    ("openai_schema_not_object", {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
     "json_schema.schema must be a JSON object"),
    ("openai_unknown_key", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}, "foo"),
    ("openai_name_not_str", {"type": "json_schema", "json_schema": {"name": 1, "schema": {}}}, "name"),
    ("openai_strict_not_bool", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}},
     "strict"),
    ("schema_nan", {"type": "json_schema", "json_schema": {"maximum": float("nan")}}, "cannot be written as JSON"),
    ("extra_key", {"type": "json_object", "schema": PERSON}, "unknown keys ['schema']"),
    ("text_extra_key", {"type": "text", "regex": "a"}, "unknown keys ['regex']"),
    ("regex_missing", {"type": "regex"}, "needs a 'regex' key"),
    ("regex_empty", {"type": "regex", "regex": ""}, "non-empty string"),
    ("regex_not_str", {"type": "regex", "regex": 5}, "non-empty string"),
    ("lark_missing", {"type": "lark", "grammar": "start: x"}, "unknown keys ['grammar']"),
]


@pytest.mark.parametrize("case,raw,mention", REJECTED, ids=[c[0] for c in REJECTED])
def test_response_format_rejected(case, raw, mention):
    with pytest.raises(ConfigError) as e:
        parse_generation_config({"response_format": raw})
    assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR
    assert "response_format" in str(e.value) and mention in str(e.value), str(e.value)


def test_from_json_plain_and_bad():
    assert ResponseFormat.from_json("") is None
    with pytest.raises(ConfigError, match="response_format is not valid JSON"):
        ResponseFormat.from_json("{nope")


# ------------------------------------------------------------------------------------------------
# llguidance on the tiny tokenizer
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tok"))
    assert build_tokenizer(d).convert_tokens_to_ids("</s>") == EOS
    with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def hf_tok(tokenizer_json):
    import tokenizers
    return tokenizers.Tokenizer.from_str(tokenizer_json)


@pytest.fixture(scope="module")
def vocab(tokenizer_json):
    v = GuidedVocabulary(tokenizer_json, VOCAB_SIZE, [EOS])
    yield v
    v.close()


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def _pick(allowed: np.ndarray, rng, prefer: np.ndarray | None = None) -> int:
    """EOS when it is the only choice, or with probability 0.2 when allowed; otherwise a random allowed
    token (from `prefer` half of the time, when any of those is allowed)."""
    if EOS in allowed and (allowed.size == 1 or rng.random() < 0.2):
        return EOS
    others = allowed[allowed != EOS]
    if prefer is not None and rng.random() < 0.5:
        preferred = np.intersect1d(others, prefer)
        if preferred.size:
            others = preferred
    return int(rng.choice(others))


def _walk(vocab, fmt: ResponseFormat, seed: int, prefer=None) -> list[int]:
    """A random walk through the grammar: tokens until EOS (excluded); fails past MAX_TOKENS."""
    rng = np.random.default_rng(seed)
    state = vocab.new_state(fmt)
    out: list[int] = []
    for _ in range(MAX_TOKENS + 1):
        allowed = _allowed(vocab.fill_masks([state])[0])
        assert allowed.size > 0 and allowed.max() < vocab.tokenizer_vocab_size
        assert not state.is_stopped or list(allowed) == [EOS]
        tok = _pick(allowed, rng, prefer)
        assert state.accept(tok), state.error
        if tok == EOS:
            assert state.is_stopped and not state.is_error
            return out
        out.append(tok)
    pytest.fail(f"no EOS within {MAX_TOKENS} tokens: {out}")


@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_random_walk_validates(vocab, hf_tok, name, schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    fmt = parse_response_format({"type": "json_schema", "json_schema": schema})
    for seed in range(4):
        ids = _walk(vocab, fmt, seed)
        text = hf_tok.decode(ids, skip_special_tokens=False)
        assert vocab.tokenizer.decode_bytes(ids).decode("utf-8") == text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_batched_in_background(vocab, hf_tok):
    """json_object mode: six walks advance together, their masks computed by start_masks on the worker
    thread; each ends in a JSON object."""
    fmt = parse_response_format({"type": "json_object"})
    prefer = np.array([hf_tok.token_to_id(t) for t in ('"', "}", "]", "1", ":")])
    rngs = [np.random.default_rng(100 + i) for i in range(6)]
    states = [vocab.new_state(fmt) for _ in rngs]
    outs: list[list[int]] = [[] for _ in rngs]
    live = list(range(len(states)))
    for _ in range(MAX_TOKENS + 1):
        if not live:
            break
        bitmask = vocab.start_masks([states[i] for i in live]).result()
        assert bitmask.shape == (len(live), vocab.words) and bitmask.dtype == np.int32
        for row, i in enumerate(list(live)):
            tok = _pick(_allowed(bitmask[row]), rngs[i], prefer)
            assert states[i].accept(tok), states[i].error
            if tok == EOS:
                live.remove(i)
            else:
                outs[i].append(tok)
    assert not live, "a json_object walk did not end"
    for ids in outs:
        assert isinstance(json.loads(hf_tok.decode(ids)), dict)


@pytest.mark.parametrize("kind,spec,pattern", [
    ("regex", r"[a-z]{2,6}-[0-9]{1,3}( (yes|no))?", r"[a-z]{2,6}-[0-9]{1,3}( (yes|no))?"),
    ("regex", r"(The|A) (quick|lazy) (fox|dog)\.", r"(The|A) (quick|lazy) (fox|dog)\."),
    ("lark", 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{1,5}/', r"(hello|hi) [a-z]{1,5}"),
])
def test_regex_and_lark(vocab, hf_tok, kind, spec, pattern):
    fmt = parse_response_format({"type": kind, kind: spec})
    for seed in range(5):
        text = hf_tok.decode(_walk(vocab, fmt, seed))
        assert re.fullmatch(pattern, text), text


def test_states_are_independent_and_grammars_cached(vocab, hf_tok):
    fmt = parse_response_format({"type": "regex", "regex": "ab|cd"})
    assert vocab.compile(fmt) is vocab.compile(fmt)
    a, b = vocab.new_state(fmt), vocab.new_state(fmt)
    assert a.accept(hf_tok.token_to_id("a")) and not a.is_accepting
    assert list(_allowed(vocab.fill_masks([a, b])[1])) == list(_allowed(vocab.fill_masks([vocab.new_state(fmt)])[0]))


def test_stop_and_error_states(vocab, hf_tok):
    fmt = parse_response_format({"type": "regex", "regex": "a+"})
    s = vocab.new_state(fmt)
    assert not s.is_accepting
    assert s.accept(hf_tok.token_to_id("a"))
    assert s.is_accepting and not s.is_stopped          # more "a" or EOS
    assert EOS in _allowed(vocab.fill_masks([s])[0])
    assert s.accept(EOS) and s.is_stopped and not s.is_error
    # a token the mask forbids puts the matcher in its error state; then only EOS is allowed
    s = vocab.new_state(fmt)
    assert not s.accept(hf_tok.token_to_id("b"))
    assert s.is_error and s.is_stopped and s.error
    assert list(_allowed(vocab.fill_masks([s])[0])) == [EOS]
    # a finished grammar (no extension possible) stops at once: only EOS is allowed
    s = vocab.new_state(parse_response_format({"type": "regex", "regex": "ab"}))
    assert s.accept(hf_tok.token_to_id("a")) and s.accept(hf_tok.token_to_id("b"))
    assert s.is_stopped and s.is_accepting and not s.is_error
    assert list(_allowed(vocab.fill_masks([s])[0])) == [EOS]


@pytest.mark.parametrize("raw,mention", [
    ({"type": "json_schema", "json_schema": {"type": "foo"}}, "json_schema is invalid: Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"$ref": "#/$defs/missing"}}, "json_schema is invalid"),
    ({"type": "json_schema", "json_schema": {"type": "string", "format": "bogus"}}, "bogus"),
    ({"type": "regex", "regex": "(("}, "regex is invalid"),
    ({"type": "lark", "lark": "start: undefined_rule"}, "undefined_rule"),
])
def test_bad_grammar_is_param_error(vocab, raw, mention):
    with pytest.raises(ConfigError) as e:
        vocab.new_state(parse_response_format(raw))
    assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR
    assert "response_format" in str(e.value) and mention in str(e.value), str(e.value)


def test_vocabulary_needs_tokenizer_and_eos(tokenizer_json):
    with pytest.raises(ValueError, match="no tokenizer"):
        GuidedVocabulary("", VOCAB_SIZE, [EOS])
    with pytest.raises(ValueError, match="EOS"):
        GuidedVocabulary(tokenizer_json, VOCAB_SIZE, [])


# ------------------------------------------------------------------------------------------------
# apply_masks
# ------------------------------------------------------------------------------------------------

def _reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            bit = (int(bitmask[i, t // 32]) >> (t % 32)) & 1 if t // 32 < words else 0
            if not bit:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[3, 0, 5], [1, 2, 3], [4]])
def test_apply_masks_matches_loop(rows, dtype):
    g = torch.Generator().manual_seed(len(rows))
    v = 600                                      # wider than the 19 words of bits: the tail is disallowed
    logits = torch.randn(6, v, generator=g).to(dtype)
    bitmask = np.random.default_rng(len(rows)).integers(-2**31, 2**31, size=(len(rows), 19), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)
    expected = _reference(logits, rows, bitmask)
    assert apply_masks(logits, rows, bitmask) is logits
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[rows, 19 * 32:]).all()


def test_masks_disallow_tokens_past_the_tokenizer(tokenizer_json, hf_tok):
    """The model's vocab (600) is larger than the tokenizer's (460): guided rows never allow those ids,
    even under a grammar that admits any text; unguided rows keep their logits."""
    big = GuidedVocabulary(tokenizer_json, 600, [EOS])
    assert big.tokenizer_vocab_size == hf_tok.get_vocab_size() < 600
    state = big.new_state(parse_response_format({"type": "regex", "regex": "(.|\n)*"}))
    bitmask = big.fill_masks([state])
    allowed = _allowed(bitmask[0])
    assert allowed.max() < big.tokenizer_vocab_size and allowed.size > 300
    logits = torch.zeros(2, 600)
    apply_masks(logits, [1], bitmask)
    assert torch.equal(logits[0], torch.zeros(600))
    assert torch.isinf(logits[1, big.tokenizer_vocab_size:]).all()
    assert torch.equal(unpack_bitmask(bitmask, 600)[0], ~torch.isinf(logits[1]))


# ------------------------------------------------------------------------------------------------
# the model file carries the tokenizer
# ------------------------------------------------------------------------------------------------

def _serialize(hf_dir: str, out_dir: str):
    from allspark_server import HuggingFaceModel
    from allspark_server.loader.model_file import read_model_graph
    loader = HuggingFaceModel(hf_dir, "tiny", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=out_dir).free_model()
    return read_model_graph(loader.graph_path, loader.weights_path)


def test_model_file_keeps_tokenizer(tmp_path, tokenizer_json):
    hf_dir = str(tmp_path / "hf")
    build_tiny_model(hf_dir, "llama_mha_tied", hidden_size=32, num_layers=1, intermediate_size=64)
    mf = _serialize(hf_dir, str(tmp_path / "as"))
    with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
        assert mf.tokenizer_json == f.read() == tokenizer_json
    v = GuidedVocabulary(mf.tokenizer_json, mf.args.vocab_size, mf.eos_token_ids)
    assert v.eos_token_ids == (EOS,) and v.words == VOCAB_SIZE // 32

    # no tokenizer.json, but files a fast tokenizer can be built from (GPT-2 style vocab.json + merges.txt)
    import tokenizers
    os.remove(os.path.join(hf_dir, "tokenizer.json"))
    for name in os.listdir(hf_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(hf_dir, name))
    tokenizers.Tokenizer.from_str(tokenizer_json).model.save(hf_dir)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>", "bos_token": "<s>"}, f)
    rebuilt = tokenizers.Tokenizer.from_str(_serialize(hf_dir, str(tmp_path / "as2")).tokenizer_json)
    text = "The quick brown fox jumps over the lazy dog."
    assert rebuilt.encode(text).ids == tokenizers.Tokenizer.from_str(tokenizer_json).encode(text).ids

    # no tokenizer at all: not an error, guided output is just unavailable
    bare = str(tmp_path / "bare")
    build_tiny_model(bare, "llama_mha_tied", hidden_size=32, num_layers=1, intermediate_size=64, tokenizer=False)
    assert _serialize(bare, str(tmp_path / "as3")).tokenizer_json == ""
