"""allspark-serve --speculative (docs/speculative.md): a server on an in-process Engine with ngram speculation gives
the same temperature-0 completion as the Engine without it, /metrics counts the proposed tokens, a request with
"speculative": false runs without it, and malformed
values of the option are argparse errors that name it."""
from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
from helpers import generate, random_prompt
from http_helpers import REPO, Server

NEW_TOKENS = 60


@pytest.fixture(scope="module")
def server(llama):
    srv = Server(llama.hf_dir, "--max-length", "512", "--max-batch", "4", "--speculative", "ngram:4",
                 "--speculative-max-batch", "2")
    yield srv
    srv.stop()


def test_completion_equals_engine_and_metrics_count_drafts(server, served_llama, llama):
    from transformers import AutoTokenizer
    engine, _ = served_llama
    tokenizer = AutoTokenizer.from_pretrained(llama.hf_dir)
    p = random_prompt(40, 5, vocab=tokenizer.vocab_size)
    ids = p + p[:20]             # a run of the prompt repeated: prompt lookup has something to propose
    want, _ = generate(engine, "llama", ids, {"top_k": 1, "max_new_tokens": NEW_TOKENS, "eos_token_id": []})
    text = tokenizer.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    r = client.completions.create(model="llama", prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == len(want) == NEW_TOKENS
    assert r.choices[0].text == text
    m = server.metrics()
    assert m['allspark_spec_draft_tokens_total{model_name="llama"}'] > 0, server.log()
    accepted = m['allspark_spec_accepted_tokens_total{model_name="llama"}']
    assert 0 <= accepted <= m['allspark_spec_draft_tokens_total{model_name="llama"}']
    assert m['allspark_spec_emitted_tokens_total{model_name="llama"}'] == \
        accepted + m['allspark_spec_verify_steps_total{model_name="llama"}']
    assert 0 <= m['allspark_spec_acceptance_rate{model_name="llama"}'] <= 1
    # allspark's request field: this one runs without speculation, the same text, counted as skipped
    r = client.completions.create(model="llama", prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "speculative": False})
    assert r.choices[0].text == text
    after = server.metrics()
    assert after['allspark_spec_draft_tokens_total{model_name="llama"}'] == \
        m['allspark_spec_draft_tokens_total{model_name="llama"}']
    assert after['allspark_spec_skipped_requests_total{model_name="llama",reason="turned_off"}'] == 1


@pytest.mark.parametrize("args, words", [
    (["--speculative", "bogus"], "argument --speculative"),     # the other malformed values: test_speculative_cli
    (["--speculative-max-batch", "2"], "--speculative-max-batch needs --speculative"),
    (["--speculative-rows", "alone"], "--speculative-rows needs --speculative"),
    (["--speculative", "ngram", "--speculative-rows", "fast"], "argument --speculative-rows"),
    (["--speculative", "ngram", "--draft-dtype", "bfloat16"], "--draft-dtype needs --speculative draft:PATH"),
    (["--draft-quantize", "int4"], "--draft-quantize needs --speculative draft:PATH"),
    (["--speculative", "draft:{model}", "--draft-quantize", "uint4_gx"],      # refused by the engine's install
     "allspark-serve: ALLSPARK_PARAM_ERROR: cannot install model 'llama_gqa_llama3': draft_quantize 'uint4_gx'"),
])
def test_malformed_speculative_is_an_error(llama, args, words, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    args = [a.format(model=llama.hf_dir) for a in args] + ["--cache-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "allspark_server.http", "--model", llama.hf_dir, *args],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and words in r.stderr, (r.returncode, r.stderr)
