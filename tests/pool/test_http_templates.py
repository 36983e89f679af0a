"""Chat templates that run long or render too much (issue 47): allspark-serve answers their requests with a 400
naming the template and keeps serving everything else. One server whose template turns hostile on a message's
content: "loop" runs two nested range(100000) loops (never ends), "big" renders ~1 MB (more than the 256-token
context can hold), "fail" raises; any other message renders like the tokenizer's own template."""
from __future__ import annotations

import json
import re
import shutil
import threading
import time

import httpx
import psutil
import pytest
from http_helpers import Server

MAX_LENGTH = 256
BUDGET_S = 1.0
HOSTILE_TEMPLATE = (
    "{% if messages[-1]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'big' %}{% for i in range(10000) %}{{ 'y' * 100 }}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'fail' %}{{ raise_exception('this template refuses fail') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    hf_dir = str(tmp_path_factory.mktemp("hostile") / "llama")
    shutil.copytree(llama.hf_dir, hf_dir)
    with open(f"{hf_dir}/tokenizer_config.json") as f:
        cfg = json.load(f)
    cfg["chat_template"] = HOSTILE_TEMPLATE
    with open(f"{hf_dir}/tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    srv = Server(hf_dir, "--max-length", str(MAX_LENGTH), "--max-batch", "4",
                 "--chat-template-timeout", str(BUDGET_S))
    srv.model_dir = hf_dir
    yield srv
    srv.stop()


def chat(server, content: str, timeout: float = 60) -> httpx.Response:
    return server.post("/chat/completions", {"model": "llama", "max_tokens": 4, "temperature": 0,
                                             "messages": [{"role": "user", "content": content}]}, timeout=timeout)


def _template_error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "chat_template_error" and err["param"] == "messages", err
    assert "chat template (tokenizer_config.json's chat_template)" in err["message"], err
    return err["message"]


def test_a_template_that_never_ends_costs_only_its_own_requests(server):
    """Ten requests whose render never ends, at once: each a 400 naming the template after the budget, while
    /health, completions and a plain chat keep being answered (the renders ran on the server's 8 control threads:
    these requests never answered, and took every thread, /health and completions included)."""
    answers: list = [None] * 10

    def hostile(i):
        try:
            answers[i] = chat(server, "loop", timeout=90)
        except httpx.HTTPError as e:
            answers[i] = e
    threads = [threading.Thread(target=hostile, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    time.sleep(0.5)                                 # they are rendering
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = server.post("/completions", {"model": "llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                    timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    for t in threads:
        t.join(120)
    for r in answers:
        assert isinstance(r, httpx.Response), f"no answer: {r!r}"
        assert f"did not finish within {BUDGET_S:g} s and was stopped" in _template_error(r)
    r = chat(server, "Hello")                        # the workers that were killed are replaced
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0


def test_a_template_that_renders_too_much_is_refused_before_tokenizing(server):
    """~1 MB of text from a 3-character message: refused in the renderer, the server's memory hardly moves
    (the prompt check counted only the messages, and tokenizing 30 MB took GBs)."""
    rss = psutil.Process(server.proc.pid).memory_info
    before = rss().rss
    message = _template_error(chat(server, "big"))
    assert re.search(r"rendered 100\d{4} characters, more than the \d+ a prompt can hold", message), message
    assert rss().rss - before < 50 << 20


def test_a_template_that_raises_is_named(server):
    assert "this template refuses fail" in _template_error(chat(server, "fail"))
