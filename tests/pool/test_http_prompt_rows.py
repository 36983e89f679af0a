"""allspark-serve's prompt logprobs and embeddings against transformers: completions with `echo` + `logprobs`
(max_tokens 0 and more, streamed and not, through raw httpx and the `openai` client), /v1/embeddings (mean pooling,
float and base64, strings and token ids, refusals), and lm-evaluation-harness's `local-completions` model pointed at
the server scoring a loglikelihood task from a local YAML + JSONL as lm-eval's own `hf` model does. One server."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from helpers import random_prompt
from http_helpers import Server
from prompt_rows_helpers import hf_embedding, hf_prompt_logprobs

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(llama):
    srv = Server(llama.hf_dir, "--max-length", "256", "--max-batch", "4", "--embedding-pooling", "mean")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(llama.hf_dir)


def _completion(server, **body):
    r = server.post("/completions", {"model": "llama", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_equal_transformers(server, llama, tokenizer, max_tokens):
    ids = random_prompt(20, seed=5, vocab=len(tokenizer))
    body = _completion(server, prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens)
    choice, n = body["choices"][0], len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n + max_tokens and body["usage"]["completion_tokens"] == max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    own, full = hf_prompt_logprobs(llama.model, ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:n], own.numpy(), atol=1e-4, rtol=0)
    for i in range(1, n):      # the 2 best of each position (two tokens' texts may coincide)
        values = sorted(lp["top_logprobs"][i].values(), reverse=True)
        best = full[i - 1].topk(2).values.numpy()
        assert np.isclose(values[0], best[0], atol=1e-4) and np.isclose(values, best[1], atol=1e-4).any()
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert choice["text"].startswith(tokenizer.decode(ids))
    assert choice["finish_reason"] == "length"


def test_echo_text_prompt_streamed_and_with_the_openai_client(server, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    whole = client.completions.create(model="llama", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert whole.choices[0].text == PROMPT and len(whole.choices[0].logprobs.tokens) == len(ids)
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, echo=True, max_tokens=2, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].text == PROMPT                       # the prompt first, then the completion
    plain = client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain.choices[0].text


def test_max_tokens_zero_needs_echo(server):
    r = server.post("/completions", {"model": "llama", "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_embeddings_equal_transformers(server, llama, tokenizer):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    texts = ["hello world", PROMPT]
    got = client.embeddings.create(model="llama", input=texts)        # the client asks for base64
    assert [d.index for d in got.data] == [0, 1]
    assert got.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    for t, d in zip(texts, got.data):
        want = hf_embedding(llama.model, tokenizer(t)["input_ids"], "mean", True)
        np.testing.assert_allclose(d.embedding, want, atol=2e-5, rtol=1e-5)
    ids = random_prompt(9, seed=3, vocab=len(tokenizer))
    r = server.post("/embeddings", {"model": "llama", "input": ids, "encoding_format": "float",
                                    "dimensions": llama.model.config.hidden_size})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], hf_embedding(llama.model, ids, "mean", True),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("body, param", [({"input": ""}, "input"), ({"input": [[]]}, "input"),
                                         ({"input": [1, 10**9]}, "input"), ({"input": "a", "dimensions": 3},
                                                                           "dimensions"),
                                         ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                                         ({"input": "a", "pooling": "cls"}, "pooling")])
def test_embeddings_refusals_name_the_field(server, body, param):
    r = server.post("/embeddings", {"model": "llama", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


DOCS = [{"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
        {"question": "A cat says", "choices": [" meow", " woof", " moo", " quack"], "answer": 2}]


def _task(tmp_path):
    data = tmp_path / "tiny_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return str(tmp_path)


def test_lm_eval_local_completions_equals_its_hf_model(server, llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=_task(tmp_path), include_defaults=False)    # lm_eval's own tasks: not read
    api = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice"], task_manager=tasks, log_samples=True,
        model_args=f"model=llama,base_url={server.base_url}/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={llama.hf_dir},num_concurrent=1,max_retries=1")
    hf = lm_eval.simple_evaluate(model="hf", tasks=["tiny_choice"], task_manager=tasks, log_samples=True,
                                 model_args=f"pretrained={llama.hf_dir},dtype=float32", device="cpu")

    def logliks(out):
        return [r[0][0] for s in out["samples"]["tiny_choice"] for r in s["resps"]]
    got, want = logliks(api), logliks(hf)
    assert len(got) == sum(len(d["choices"]) for d in DOCS)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    assert api["results"]["tiny_choice"]["acc,none"] == hf["results"]["tiny_choice"]["acc,none"]
