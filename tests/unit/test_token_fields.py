"""The HTTP fields that name token ids, on hand-worked bodies: logit_bias's string keys become ints in the generation
config, stop_token_ids become single-token stop words; bad shapes are 400s naming the field; the engine's messages
about them map back to the OpenAI field; /tokenize and /detokenize bodies are read as vLLM documents them."""
from __future__ import annotations

import pytest

from allspark_client.types import AsStatus
from allspark_server.http.protocol import ApiError, error_from_engine, generation_config, parse_chat, parse_completion
from allspark_server.http.tokenize_routes import parse_detokenize, parse_tokenize

BODY = {"model": "m", "prompt": "hi"}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_logit_bias_and_stop_token_ids_reach_the_generation_config():
    req = parse_completion({**BODY, "logit_bias": {"12": -100, " 7": 2.5}, "stop_token_ids": [5, 9, 5]}, "m")
    gen = generation_config(req, 3, 10, {})
    assert gen["logit_bias"] == {12: -100, 7: 2.5}
    assert gen["stop_words_ids"] == [[5], [9]] and req.stop_token_ids == (5, 9)
    chat = parse_chat({"model": "m", "messages": MESSAGES, "logit_bias": {}, "stop_token_ids": []}, "m")
    gen = generation_config(chat, 3, 10, {})
    assert gen["logit_bias"] == {} and "stop_words_ids" not in gen


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"a1": 1}), ("logit_bias", {"-3": 1}), ("logit_bias", {"1.5": 1}), ("logit_bias", {"3": "1"}),
    ("logit_bias", {"3": True}), ("logit_bias", [1, 2]), ("stop_token_ids", [1, -1]), ("stop_token_ids", ["1"]),
    ("stop_token_ids", [True]), ("stop_token_ids", list(range(65))), ("stop_token_ids", 5),
])
def test_bad_fields_are_400s_naming_them(field, value):
    for parse, body in ((parse_completion, BODY), (parse_chat, {"model": "m", "messages": MESSAGES})):
        with pytest.raises(ApiError) as e:
            parse({**body, field: value}, "m")
        assert e.value.status == 400 and e.value.param == field, e.value.message


@pytest.mark.parametrize("message, param", [
    ("logit_bias keys must be token ids in [0, 512), got 600", "logit_bias"),
    ("logit_bias[3] must be in [-100.0, 100.0], got 101.0", "logit_bias"),
    ("stop_words_ids entries must be token ids in [0, 512), got 600", "stop_token_ids"),
])
def test_engine_errors_name_the_openai_field(message, param):
    err = error_from_engine(AsStatus.ALLSPARK_PARAM_ERROR, message, "completion")
    assert (err.status, err.param) == (400, param)


def test_tokenize_bodies():
    t = parse_tokenize({"prompt": "hi"}, "m")
    assert (t.prompt, t.chat, t.add_special_tokens, t.add_generation_prompt, t.return_token_strs) == \
        ("hi", None, True, True, False)
    t = parse_tokenize({"model": "m", "messages": MESSAGES, "add_generation_prompt": False}, "m")
    assert t.chat.messages == MESSAGES and (t.add_special_tokens, t.add_generation_prompt) == (False, False)
    assert parse_tokenize({"model": "lora1", "prompt": "x", "add_special_tokens": False}, "m", ["lora1"]) \
        .add_special_tokens is False
    assert parse_detokenize({"tokens": [1, 2]}, "m") == [1, 2]
    for bad, param, status in (({"prompt": "x", "messages": MESSAGES}, "prompt", 400), ({}, "messages", 400),
                               ({"prompt": "x", "model": "other"}, "model", 404),
                               ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens", 400),
                               ({"messages": "hi"}, "messages", 400), ({"prompt": "x", "tools": []}, "tools", 400)):
        with pytest.raises(ApiError) as e:
            parse_tokenize(bad, "m")
        assert (e.value.status, e.value.param) == (status, param), e.value.message
    for bad in ({}, {"tokens": [1.0]}, {"tokens": [False]}, {"tokens": [-1]}, {"tokens": [1], "prompt": "x"}):
        with pytest.raises(ApiError):
            parse_detokenize(bad, "m")
