"""allspark-serve's token-id features against transformers and the official `openai` client, on the session's chat
server (conftest's chat_llama_server: API key set, chat template added): /tokenize (a prompt; messages through the
chat template, with and without the generation prompt) equals the HF tokenizer and the chat endpoint's prompt count,
/detokenize its decode, both behind the key; logit_bias (OpenAI's string keys) on completions and chat: greedy
equals transformers' greedy loop over logits + bias, -100 bans tokens from a sampled run, +100 forces one, bad ones
are 400s naming logit_bias; vLLM's stop_token_ids end the output at the first such token, left out of the text; a
seed repeats a sampled request and another seed changes it."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from helpers import hf_logits, hf_loop
from http_helpers import API_KEY, CHAT_MAX_LENGTH, folder_tokenizer

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(chat_llama_server):
    return chat_llama_server


@pytest.fixture(scope="module")
def tokenizer(server):
    return folder_tokenizer(server)                  # the server's own folder: with the chat template


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def post(server, path, body, headers=AUTH):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- /tokenize, /detokenize ----------------------------------------------------------------------------------
def test_tokenize_prompt_and_detokenize(server, tokenizer):
    for special in (True, False):
        r = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": special, "return_token_strs": True})
        assert r.status_code == 200, r.text
        want = tokenizer(PROMPT, add_special_tokens=special)["input_ids"]
        assert r.json() == {"count": len(want), "max_model_len": CHAT_MAX_LENGTH, "tokens": want,
                            "token_strs": tokenizer.convert_ids_to_tokens(want)}
    assert post(server, "/tokenize", {"model": "llama", "prompt": PROMPT}).json()["tokens"] == \
        tokenizer(PROMPT)["input_ids"]
    ids = tokenizer("Hello world! Once upon a time")["input_ids"] + [tokenizer.eos_token_id]
    r = post(server, "/detokenize", {"model": "llama", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_as_the_chat_endpoint(server, tokenizer, client):
    for gen_prompt in (True, False):
        r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": gen_prompt})
        assert r.status_code == 200, r.text
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt, tokenize=False)
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    counted = post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == counted


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": PROMPT, "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"model": "nope", "prompt": PROMPT}, 404, "model"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_tokenize_errors(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tokenize_routes_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5]})):
        assert post(server, path, body, headers={}).status_code == 401
        assert post(server, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401


# ---- logit_bias -----------------------------------------------------------------------------------------------
def test_logit_bias_greedy_follows_hf(client, llama, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    order = torch.argsort(hf_logits(llama.model, ids)[-1], descending=True).tolist()
    bias = {order[0]: -100, order[4]: 2.5, order[7]: 4}

    def biased(_ids, _out, lg):
        lg = lg.clone()
        for t, b in bias.items():
            lg[t] += b
        return lg
    ref = hf_loop(llama.model, ids, 10, biased, dtype=torch.float32)
    assert ref[0] != order[0] and ref != hf_loop(llama.model, ids, 10, lambda i, o, lg: lg, dtype=torch.float32)
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=10, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()}, extra_body=NO_EOS)
    assert r.choices[0].text == decode(tokenizer, ref)


def test_logit_bias_bans_and_forces(client, tokenizer):
    """-100 on every token whose text holds a letter that a hot sampled run wrote: the same run (same seed) then
    writes that letter nowhere."""
    sampled = dict(model="llama", prompt=PROMPT, max_tokens=32, temperature=1.5, seed=4, extra_body=NO_EOS)
    text = client.completions.create(**sampled).choices[0].text
    letter = next(c for c in "eositan" if c in text)
    banned = [i for i in range(len(tokenizer)) if letter in tokenizer.decode([i])]
    assert 10 < len(banned) <= 300
    r = client.completions.create(logit_bias={str(t): -100 for t in banned}, **sampled)
    assert r.usage.completion_tokens == 32 and letter not in r.choices[0].text and r.choices[0].text != text
    # +100 forces one token, sampled and greedy, in chat and completions
    forced = tokenizer(" fox", add_special_tokens=False)["input_ids"][-1]
    text = decode(tokenizer, [forced] * 6)
    for temperature in (0, 1.0):
        r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=6, temperature=temperature, seed=1,
                                      logit_bias={str(forced): 100}, extra_body=NO_EOS)
        assert r.choices[0].text == text
        c = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=6, temperature=temperature,
                                           seed=1, logit_bias={str(forced): 100}, extra_body=NO_EOS)
        assert c.choices[0].message.content == text


@pytest.mark.parametrize("bias, needle", [({"abc": 1}, "not a token id"), ({"5": 101}, "logit_bias[5]"),
                                          ({"5": "1"}, "expected a number"), ({str(10**6): 1}, "logit_bias keys"),
                                          ({str(i): 1 for i in range(301)}, "at most 300")])
def test_bad_logit_bias_is_400(server, bias, needle):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = post(server, path, {"model": "llama", "max_tokens": 2, "logit_bias": bias, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and needle in err["message"], err


# ---- stop_token_ids ---------------------------------------------------------------------------------------------
def test_stop_token_ids_end_the_output(client, server, tokenizer):
    full = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=NO_EOS)
    tokens = tokenizer(PROMPT + full.choices[0].text, add_special_tokens=False)["input_ids"][
        len(tokenizer(PROMPT)["input_ids"]):]
    assert full.usage.completion_tokens == 16
    stop_at = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])     # a token's first appearance
    unused = next(t for t in range(3, len(tokenizer)) if t not in tokens)
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={**NO_EOS, "stop_token_ids": [unused, tokens[stop_at]]})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", stop_at + 1)
    assert r.choices[0].text == decode(tokenizer, tokens[:stop_at])
    c = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=4, temperature=0,
                                       extra_body={"stop_token_ids": []})
    assert c.choices[0].finish_reason in ("stop", "length")
    for bad, needle in (([1, "x"], "array of token ids"), ([10**6], "stop_words_ids")):
        r = post(server, "/v1/completions", {"model": "llama", "prompt": PROMPT, "stop_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert needle in r.json()["error"]["message"]


# ---- seed -------------------------------------------------------------------------------------------------------
def test_seed_repeats_and_differs(client):
    def completion(seed):
        return client.completions.create(model="llama", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed,
                                         extra_body=NO_EOS).choices[0].text

    def chat(seed):
        return client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=24, temperature=1.0,
                                              seed=seed, extra_body=NO_EOS).choices[0].message.content
    for call in (completion, chat):
        a, b, c = call(11), call(11), call(12)
        assert a == b and a != c
