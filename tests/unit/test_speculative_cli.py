"""allspark-serve's speculative decoding plumbing without a model: --speculative's values, the runtime config
they build, the request field, and the spec_* metrics of /metrics."""
from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from allspark_client.config import AsModelRuntimeConfigBuilder
from allspark_client.types import AsEngineStat
from allspark_server.http.backend import BackendOptions, speculative_config
from allspark_server.http.cli import parse_args, speculative_spec
from allspark_server.http.metrics import Metrics
from allspark_server.http.protocol import generation_config, parse_chat, parse_completion


@pytest.mark.parametrize("value, want", [
    ("ngram", ("ngram", "", 0)),
    ("ngram:6", ("ngram", "", 6)),
    ("draft:/models/small", ("draft", "/models/small", 0)),
    ("draft:/models/small:3", ("draft", "/models/small", 3)),
    ("draft:/odd:name", ("draft", "/odd:name", 0)),          # a last part that is no number belongs to the path
])
def test_speculative_values(value, want):
    assert speculative_spec(value) == want


@pytest.mark.parametrize("value", ["bogus", "", "ngram:", "ngram:0", "ngram:17", "ngram:x", "draft", "draft:",
                                   "draft:/m:0", "Ngram"])
def test_malformed_speculative_values(value):
    with pytest.raises(argparse.ArgumentTypeError):
        speculative_spec(value)


def test_parse_args_and_config():
    args = parse_args(["--model", "/m", "--speculative", "draft:/d:5", "--speculative-max-batch", "2"])
    assert args.speculative == ("draft", "/d", 5) and args.speculative_max_batch == 2
    assert parse_args(["--model", "/m"]).speculative is None

    def built(opts):
        b = AsModelRuntimeConfigBuilder().model_name("m").model_file_path("/g.asgraph", "/g.asparam")
        return speculative_config(b, opts).build()
    cfg = built(BackendOptions(model="/m", speculative=("draft", "/d", 5), speculative_max_batch=2))
    assert (cfg.speculative_method, cfg.draft_model, cfg.num_speculative_tokens, cfg.speculative_max_batch) == \
        ("draft", "/d", 5, 2)
    cfg = built(BackendOptions(model="/m", speculative=("ngram", "", 0)))
    assert (cfg.speculative_method, cfg.speculative_tokens, cfg.draft_model, cfg.speculative_rows) == \
        ("ngram", 4, "", "auto")
    args = parse_args(["--model", "/m", "--speculative", "ngram:8", "--speculative-rows", "alone"])
    assert args.speculative_rows == "alone"
    cfg = built(BackendOptions(model="/m", speculative=args.speculative, speculative_rows=args.speculative_rows))
    assert (cfg.speculative_tokens, cfg.speculative_rows) == (8, "alone")
    assert built(BackendOptions(model="/m")).speculative_method == ""
    args = parse_args(["--model", "/m", "--speculative", "draft:/d", "--draft-dtype", "bfloat16",
                       "--draft-quantize", "uint4_g128+fp_head"])
    cfg = built(BackendOptions(model="/m", speculative=args.speculative, draft_dtype=args.draft_dtype,
                               draft_quantize=args.draft_quantize))
    assert (cfg.draft_model, cfg.draft_dtype, cfg.draft_quantize) == ("/d", "bfloat16", "uint4_g128+fp_head")


def test_request_field_reaches_the_generation_config():
    req = parse_completion({"model": "m", "prompt": [1, 2], "speculative": False}, "m")
    assert generation_config(req, 2, 8, {})["speculative"] is False
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative": True}, "m")
    assert generation_config(req, 2, 8, {})["speculative"] is True
    req = parse_completion({"model": "m", "prompt": [1, 2]}, "m")
    assert "speculative" not in generation_config(req, 2, 8, {})


def test_spec_metrics():
    stat = AsEngineStat(spec_draft_tokens=12, spec_accepted_tokens=9, spec_emitted_tokens=12, spec_verify_steps=3,
                        spec_acceptance_rate=0.75, spec_skipped="response_format=2, turned_off=1")
    text = Metrics("llama").render(stat).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    model = (("model_name", "llama"),)
    assert got[("allspark_spec_draft_tokens_total", model)] == 12
    assert got[("allspark_spec_accepted_tokens_total", model)] == 9
    assert got[("allspark_spec_emitted_tokens_total", model)] == 12
    assert got[("allspark_spec_verify_steps_total", model)] == 3
    assert got[("allspark_spec_acceptance_rate", model)] == 0.75
    assert got[("allspark_spec_skipped_requests_total", (*model, ("reason", "response_format")))] == 2
    assert got[("allspark_spec_skipped_requests_total", (*model, ("reason", "turned_off")))] == 1
