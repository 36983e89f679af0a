"""Guided output through the engines: every schema of json_schemas.py served by an Engine (sampled and greedy,
all at once in one batch with unguided requests) must give text that `json.loads` and `jsonschema` accept; the
unguided neighbours keep their own tokens; grammars end requests whatever their eos_token_id; max_length cut-offs
say so; bad formats are PARAM_ERRORs while the engine keeps serving; and the same through a 2-rank pool."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from helpers import collect, greedy, random_prompt, serialize, start_engine
from json_schemas import SCHEMAS
from transformers import AutoTokenizer

from allspark_client import AsStatus, GenerateRequestStatus
from allspark_server import HuggingFaceModel

MAX_NEW = 300


@pytest.fixture(scope="module")
def guided(llama, tmp_path_factory):
    loader = serialize(llama.hf_dir, "guided", str(tmp_path_factory.mktemp("guided")))
    engine = start_engine(loader, "guided", max_batch=16, max_length=512)
    yield engine, loader, AutoTokenizer.from_pretrained(llama.hf_dir)
    engine.release_model("guided")


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def _run(engine, name, prompt, gen):
    status, handle, queue = engine.start_request(name, {"input_ids": prompt}, gen)
    assert status == 0, engine.get_last_error()
    tokens, _, final = collect(queue)
    message = queue.ErrorMessage()
    engine.release_request(name, handle)
    return tokens, final, message


def _text(tok, tokens):
    return tok.decode([t for t in tokens if t != tok.eos_token_id])


def test_every_schema_validates_sampled_and_greedy_in_one_batch(guided):
    engine, _, tok = guided
    jobs = []
    for i, (name, schema) in enumerate(SCHEMAS):
        jobs.append((name, schema, {"response_format": _schema_format(schema), "temperature": 1.0, "seed": i,
                                    "max_new_tokens": MAX_NEW}))
        jobs.append((name, schema, {"response_format": _schema_format(schema), "top_k": 1, "max_new_tokens": MAX_NEW,
                                    "eos_token_id": []}))   # the grammar ends it, not EOS
    plain = [random_prompt(20 + i, seed=40 + i) for i in range(4)]
    want_plain = [greedy(engine, "guided", p, 40) for p in plain]
    results, errors = {}, []

    def run(key, prompt, gen):
        try:
            results[key] = _run(engine, "guided", prompt, gen)
        except Exception as e:   # reported below
            errors.append(f"{key}: {e!r}")
    threads = [threading.Thread(target=run, args=(j, random_prompt(8, seed=j), gen))
               for j, (_, _, gen) in enumerate(jobs)]
    threads += [threading.Thread(target=run, args=(f"plain{i}", p, {"top_k": 1, "max_new_tokens": 40,
                                                                     "eos_token_id": []}))
                for i, p in enumerate(plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for j, (name, schema, _) in enumerate(jobs):
        tokens, final, message = results[j]
        assert final == GenerateRequestStatus.GenerateFinished and not message, (name, final, message)
        assert len(tokens) < MAX_NEW, f"{name}: the grammar should have ended it"
        value = json.loads(_text(tok, tokens))
        jsonschema.validate(value, schema)
    assert [results[f"plain{i}"][0] for i in range(len(plain))] == want_plain


def test_json_object_regex_and_eos(guided):
    engine, _, tok = guided
    # any object: nothing bounds its strings, so a random model may run out of tokens inside one; either way the
    # output is a complete object or a cut-off that says so
    complete = 0
    for seed in range(6):
        tokens, final, message = _run(engine, "guided", random_prompt(10, 1),
                                      {"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": seed,
                                       "max_new_tokens": MAX_NEW})
        if message:
            assert "cut off" in message and len(tokens) == MAX_NEW
            continue
        assert isinstance(json.loads(_text(tok, tokens)), dict)   # ended by the grammar (EOS or the last brace)
        complete += 1
    assert complete >= 1, "no json_object run completed"
    tokens, _, _ = _run(engine, "guided", random_prompt(10, 2),
                        {"response_format": {"type": "regex", "regex": "(yes|no), [0-9]{2}"}, "temperature": 1.0,
                         "seed": 3, "max_new_tokens": 40})
    import re
    assert re.fullmatch("(yes|no), [0-9]{2}", _text(tok, tokens))


def test_max_length_mid_object_finishes_and_says_so(guided):
    engine, _, tok = guided
    schema = dict(SCHEMAS)["order"]
    tokens, final, message = _run(engine, "guided", random_prompt(10, 3),
                                  {"response_format": _schema_format(schema), "top_k": 1, "max_new_tokens": 4})
    assert final == GenerateRequestStatus.GenerateFinished and len(tokens) == 4
    assert "max_length" in message and "cut off" in message
    with pytest.raises(json.JSONDecodeError):
        json.loads(_text(tok, tokens))


@pytest.mark.parametrize("fmt,mention", [
    ({"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"type": "regex", "regex": "(unclosed"}, "regex"),
    ({"type": "json_object", "json_schema": "{not json"}, "json_schema"),
    ({"type": "xml"}, "xml"),
])
def test_bad_formats_are_param_errors_and_the_engine_keeps_serving(guided, fmt, mention):
    engine, _, _ = guided
    status, handle, queue = engine.start_request("guided", {"input_ids": [5, 6, 7]},
                                                 {"response_format": fmt, "max_new_tokens": 5})
    assert status == AsStatus.ALLSPARK_PARAM_ERROR and handle is None
    assert mention in engine.get_last_error(), engine.get_last_error()
    p = random_prompt(12, 5)
    assert len(greedy(engine, "guided", p, 5)) == 5


def test_a_model_without_tokenizer_refuses_guided_requests_clearly(llama, tmp_path):
    import os
    import shutil
    hf = str(tmp_path / "hf")
    shutil.copytree(llama.hf_dir, hf)
    for f in os.listdir(hf):
        if "token" in f or f in ("vocab.json", "merges.txt"):
            os.remove(os.path.join(hf, f))
    loader = HuggingFaceModel(hf, "notok", user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path / "as")).free_model()
    engine = start_engine(loader, "notok", max_batch=2, max_length=64)
    status, _, _ = engine.start_request("notok", {"input_ids": [5, 6]}, {"response_format": {"type": "json_object"}})
    assert status == AsStatus.ALLSPARK_PARAM_ERROR and "tokenizer" in engine.get_last_error()
    assert len(greedy(engine, "notok", [5, 6, 7], 3)) == 3
    engine.release_model("notok")


def test_pool_serves_guided_output_like_the_engine(pool, guided):
    client, _ = pool
    engine, _, tok = guided
    for name in ("person", "order", "array_of_objects"):
        schema = dict(SCHEMAS)[name]
        gen = {"response_format": _schema_format(schema), "top_k": 1, "max_new_tokens": MAX_NEW}
        prompt = random_prompt(9, seed=len(name))
        want, _, _ = _run(engine, "guided", prompt, gen)
        got, final, message = _run(client, "llama", prompt, gen)
        assert final == GenerateRequestStatus.GenerateFinished and not message
        assert got == want
        jsonschema.validate(json.loads(_text(tok, got)), schema)
    status, _, _ = client.start_request("llama", {"input_ids": [5]}, {"response_format": {"type": "regex",
                                                                                         "regex": "(bad"}})
    assert status == AsStatus.ALLSPARK_PARAM_ERROR
