"""LoRA adapters through allspark-serve (docs/http.md, "LoRA adapters"), vLLM's shape: a request's `model` names the
base model or a loaded adapter; /v1/models lists the adapters with their `parent`; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter behind the API key, the engine's statuses as OpenAI errors (404, 400, 409); --lora-modules.
First the app over a fake engine (what reaches the engine, every error), then a real server started with
--lora-modules: the `openai` client's greedy output for model=<adapter> equals transformers + PEFT, and an adapter
loaded and unloaded at run time."""
from __future__ import annotations

import argparse
import threading

import pytest
from http_helpers import API_KEY
from test_lora_client import PROMPT, TOKENS, make_peft_adapter, needs_engine_lora

from allspark_client import AsStatus, GeneratedElements, GenerateRequestStatus, ResultQueue
from allspark_server.http.lora_requests import check_lora_modules, lora_module

BASE = "base"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class FakeEngine:
    """start_request answers at once with `reply` tokens; the LoRA calls follow the Engine's contract."""

    def __init__(self, reply: list[int]):
        self.reply = reply
        self.loaded: dict[str, str] = {}
        self.in_use: set[str] = set()
        self.started: list[dict] = []
        self.start_status = AsStatus.ALLSPARK_SUCCESS
        self._errors = threading.local()

    def is_allspark_work_as_service(self):
        return False

    def _fail(self, status, message):
        self._errors.message = message
        return status

    def get_last_error(self):
        return getattr(self._errors, "message", "")

    def start_request(self, name, inputs, gen):
        self.started.append(dict(gen))
        if self.start_status != AsStatus.ALLSPARK_SUCCESS:
            return self._fail(self.start_status, f"LoRA adapter {gen.get('lora_name')!r} is not loaded"), None, None
        queue = ResultQueue(context_length=len(inputs["input_ids"]))
        queue._push(GeneratedElements(list(self.reply)), GenerateRequestStatus.Generating)
        queue._set_status(GenerateRequestStatus.GenerateFinished)
        return AsStatus.ALLSPARK_SUCCESS, object(), queue

    def release_request(self, name, handle):
        return AsStatus.ALLSPARK_SUCCESS

    def load_lora(self, model_name, lora_name, path=None):
        if lora_name in self.loaded:
            return self._fail(AsStatus.ALLSPARK_LORA_ALREADY_LOADED, f"LoRA adapter {lora_name!r} is loaded already")
        if "missing" in path:
            return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND, f"no adapter file or folder {path!r}")
        if "rank128" in path:
            return self._fail(AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR, "rank 128 > lora_max_rank 64")
        if "broken" in path:
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, "adapter_config.json: target module 'lm_head' unknown")
        if len(self.loaded) >= 2:
            return self._fail(AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR, "lora_max_num (2) adapters are loaded")
        self.loaded[lora_name] = path
        return AsStatus.ALLSPARK_SUCCESS

    def unload_lora(self, model_name, lora_name):
        if lora_name not in self.loaded:
            return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND, f"LoRA adapter {lora_name!r} is not loaded")
        if lora_name in self.in_use:
            return self._fail(AsStatus.ALLSPARK_LORA_IN_USE, f"LoRA adapter {lora_name!r} is in use")
        del self.loaded[lora_name]
        return AsStatus.ALLSPARK_SUCCESS

    def list_loras(self, model_name):
        return sorted(self.loaded)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """(fake engine, starlette TestClient) of the app over it, with an API key."""
    from starlette.testclient import TestClient

    from allspark_server.http.app import create_app
    from allspark_server.http.backend import Backend
    from allspark_server.loader.tiny_model import build_tokenizer
    tokenizer = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    engine = FakeEngine(tokenizer(" fine words", add_special_tokens=False)["input_ids"])
    backend = Backend(engine, BASE, tokenizer, 128, [tokenizer.eos_token_id], {}, owns_engine=False)
    with TestClient(create_app(backend, api_key=API_KEY)) as client:
        yield engine, client


def _error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


def test_adapters_are_loaded_listed_served_and_unloaded(fake):
    engine, http = fake
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/adapters/ad1"}, headers=AUTH)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad1' added successfully."
    assert engine.loaded == {"ad1": "/adapters/ad1"}
    models = http.get("/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [(BASE, None, None),
                                                                          ("ad1", BASE, "/adapters/ad1")]
    assert all(m["max_model_len"] == 128 and m["object"] == "model" for m in models)
    r = http.post("/v1/completions", json={"model": "ad1", "prompt": [5, 6, 7], "max_tokens": 4}, headers=AUTH)
    assert r.status_code == 200 and r.json()["model"] == "ad1" and r.json()["choices"][0]["text"] == " fine words"
    assert engine.started[-1]["lora_name"] == "ad1"
    r = http.post("/v1/completions", json={"model": BASE, "prompt": [5, 6, 7], "max_tokens": 4}, headers=AUTH)
    assert r.status_code == 200 and r.json()["model"] == BASE and "lora_name" not in engine.started[-1]
    e = _error(http.post("/v1/completions", json={"model": "ad2", "prompt": [5], "max_tokens": 1}, headers=AUTH),
               404)
    assert e["code"] == "model_not_found" and e["param"] == "model" and "'ad1'" in e["message"]
    engine.loaded["other"] = "/elsewhere"         # loaded by another client of a shared pool: found on a miss
    r = http.post("/v1/completions", json={"model": "other", "prompt": [5], "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 200 and engine.started[-1]["lora_name"] == "other"
    assert [m["id"] for m in http.get("/v1/models", headers=AUTH).json()["data"]] == [BASE, "ad1", "other"]
    engine.in_use.add("ad1")
    e = _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}, headers=AUTH), 409)
    assert e["code"] == "lora_in_use" and "in use" in e["message"]
    engine.in_use.clear()
    for name in ("ad1", "other"):
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH)
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' removed successfully."
    e = _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}, headers=AUTH), 404)
    assert e["code"] == "lora_not_found" and e["param"] == "lora_name"
    e = _error(http.post("/v1/chat/completions", json={"model": "ad1", "messages": [{"role": "user", "content": "x"}]},
                         headers=AUTH), 404)
    assert e["code"] == "model_not_found"
    assert [m["id"] for m in http.get("/v1/models", headers=AUTH).json()["data"]] == [BASE]


def test_load_and_unload_errors(fake):
    engine, http = fake

    def load(body, headers=AUTH):
        return http.post("/v1/load_lora_adapter", json=body, headers=headers)
    assert _error(load({"lora_name": "a", "lora_path": "/a"}, headers={}), 401)["code"] == "invalid_api_key"
    assert _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 401)["code"] == "invalid_api_key"
    refused = [({"lora_path": "/a"}, "lora_name"), ({"lora_name": "a"}, "lora_path"),
               ({"lora_name": 3, "lora_path": "/a"}, "lora_name"),
               ({"lora_name": "a", "lora_path": ["/a"]}, "lora_path"),
               ({"lora_name": "a", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
               ({"lora_name": BASE, "lora_path": "/a"}, "lora_name"),
               ({"lora_name": "", "lora_path": "/a"}, "lora_name")]
    for body, param in refused:
        assert _error(load(body), 400)["param"] == param, body
    assert _error(load(["a"]), 400)["message"].startswith("the request body must be a JSON object")
    assert not engine.loaded                                 # none of those reached the engine
    assert load({"lora_name": "a", "lora_path": "/a"}).status_code == 200
    for body, status, code, param, reason in (
            ({"lora_name": "a", "lora_path": "/a"}, 409, "lora_already_loaded", "lora_name", "loaded already"),
            ({"lora_name": "b", "lora_path": "/missing"}, 404, "lora_not_found", "lora_path", "no adapter file"),
            ({"lora_name": "b", "lora_path": "/rank128"}, 400, "lora_rank_exceeded", "lora_path", "lora_max_rank"),
            ({"lora_name": "b", "lora_path": "/broken"}, 400, "invalid_lora_adapter", "lora_path", "'lm_head'")):
        e = _error(load(body), status)
        assert (e["code"], e["param"], e["type"]) == (code, param, "invalid_request_error"), e
        assert reason in e["message"], e
    assert load({"lora_name": "b", "lora_path": "/b"}).status_code == 200
    e = _error(load({"lora_name": "c", "lora_path": "/c"}), 400)
    assert e["code"] == "lora_limit_exceeded" and e["param"] is None and "lora_max_num" in e["message"]
    assert _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a", "x": 1}, headers=AUTH), 400)["param"] \
        == "x"
    # an adapter unloaded between the request's check and its start: 404, not a 500
    engine.start_status = AsStatus.ALLSPARK_LORA_NOT_FOUND
    try:
        e = _error(http.post("/v1/completions", json={"model": "a", "prompt": [5], "max_tokens": 1}, headers=AUTH), 404)
        assert e["code"] == "model_not_found" and "not loaded" in e["message"]
    finally:
        engine.start_status = AsStatus.ALLSPARK_SUCCESS
    for name in ("a", "b"):
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH).status_code == 200
    metrics = http.get("/metrics").text
    assert 'allspark_http_requests_total{endpoint="/v1/load_lora_adapter",status="409"} 1.0' in metrics


def test_lora_modules_option(tmp_path):
    from allspark_server.http.cli import check_lora_options, parse_args
    assert lora_module("ad1=/x/ad1") == ("ad1", "/x/ad1")
    assert lora_module("a=b=c") == ("a", "b=c")
    assert lora_module('{"name": "ad1", "path": "/x", "base_model_name": "m"}') == ("ad1", "/x")
    for bad in ("ad1", "=/x", "ad1=", '{"name": "a"}', '{"name": "a", "path": "/x", "scale": 2}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
    assert check_lora_modules([("a", "/x"), ("b", "/y")], BASE) is None
    assert "more than once" in check_lora_modules([("a", "/x"), ("a", "/y")], BASE)
    assert "served model's name" in check_lora_modules([(BASE, "/x")], BASE)
    (tmp_path / "a").mkdir()
    args = parse_args(["--model", "m", "--lora-modules", f"a={tmp_path / 'a'}", "--max-loras", "2",
                       "--max-lora-rank", "16"])
    assert args.lora_modules == [("a", str(tmp_path / "a"))] and (args.max_loras, args.max_lora_rank) == (2, 16)
    check_lora_options(args)
    for argv, message in ((["--lora-modules", f"b={tmp_path / 'b'}"], "no such adapter"),
                          (["--max-loras", "-1"], "--max-loras"), (["--max-lora-rank", "0"], "--max-lora-rank"),
                          (["--max-loras", "0", "--lora-modules", f"a={tmp_path / 'a'}"], "more than --max-loras")):
        with pytest.raises(SystemExit, match=message):
            check_lora_options(parse_args(["--model", "m", *argv]))


# ---- end to end: allspark-serve --lora-modules, the openai client, transformers + PEFT as the reference -----------
@needs_engine_lora
def test_openai_client_gets_the_adapters_greedy_output(llama, tmp_path):
    import openai
    from helpers import hf_greedy
    from http_helpers import Server
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(llama.hf_dir)
    refs = {}
    for name, rank, seed in (("ad8", 8, 11), ("ad16", 16, 12)):
        peft_model = make_peft_adapter(llama.model, str(tmp_path / name), rank=rank, seed=seed)
        refs[name] = hf_greedy(peft_model, PROMPT, TOKENS)
    refs[BASE] = hf_greedy(llama.model, PROMPT, TOKENS)
    assert refs["ad8"] != refs[BASE] and refs["ad16"] != refs[BASE]

    def text(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    server = Server(llama.hf_dir, "--max-length", "256", "--lora-modules", f"ad8={tmp_path / 'ad8'}",
                    api_key=API_KEY, name=BASE)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == [BASE, "ad8"] and models[1].model_extra["parent"] == BASE

        def complete(model, **kw):
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)
            return r.choices[0].text, r.model
        assert complete("ad8") == (text(refs["ad8"]), "ad8")
        assert complete(BASE) == (text(refs[BASE]), BASE)
        r = server.post("/load_lora_adapter", {"lora_name": "ad16", "lora_path": str(tmp_path / "ad16")})
        assert r.status_code == 200, r.text
        assert server.post("/load_lora_adapter", {"lora_name": "ad16", "lora_path": str(tmp_path / "ad16")}
                           ).status_code == 409
        stream = client.completions.create(model="ad16", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == text(refs["ad16"])
        assert server.post("/unload_lora_adapter", {"lora_name": "ad16"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("ad16")
        assert [m.id for m in client.models.list().data] == [BASE, "ad8"]
    except BaseException:
        print(server.log())
        raise
    finally:
        server.stop()
