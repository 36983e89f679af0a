"""allspark-serve with a Qwen2-VL folder: the official `openai` client sends base64 images in a chat (OpenAI
`image_url` parts with data: URLs) and gets, streamed and not, the text of transformers' greedy continuation of
the same chat and images; bad images, remote URLs and wrong parts get 400s naming the problem while the server
keeps serving."""
from __future__ import annotations

import base64

import openai
import pytest
from http_helpers import API_KEY, Server
from test_vl_engine import NEW_TOKENS as TOKENS
from test_vl_engine import hf_greedy
from vl_cases import build_vl_model, chat, data_url, hf_inputs, hf_processor, make_image


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("vl") / "qwen2_vl")
    hf = build_vl_model(folder, "qwen2_vl")
    srv = Server(folder, "--max-length", "1024", api_key=API_KEY, name="qwen2_vl")
    yield srv, hf, folder
    srv.stop()


def expected_text(hf, folder, images) -> str:
    processor = hf_processor(folder)
    inputs = hf_inputs(folder, images, messages=chat(len(images)), processor=processor)
    tokens = hf_greedy(hf, inputs)          # EOS not special: the server's ignore_eos
    return processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_openai_client_chats_about_images_streamed_and_not(served):
    srv, hf, folder = served
    client = openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0)
    images = [make_image(84, 56, seed=3), make_image(56, 112, seed=4)]
    for n in (1, 2):
        want = expected_text(hf, folder, images[:n])
        messages = chat(n, urls=[data_url(im) for im in images[:n]])
        kw = dict(model="qwen2_vl", messages=messages, max_tokens=TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == want
        stream = client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    # a JPEG too, and the prompt's image tokens counted in usage
    jpeg = data_url(images[0], "JPEG")
    r = client.chat.completions.create(model="qwen2_vl", messages=chat(1, urls=[jpeg]), max_tokens=2)
    assert r.usage.prompt_tokens > 20 and r.choices[0].finish_reason in ("stop", "length")


def test_bad_images_are_400s_and_the_server_keeps_serving(served):
    srv, hf, folder = served
    good = data_url(make_image(56, 56, seed=5))
    cases = {
        "corrupt": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(),
        "remote": "https://example.com/cat.png",
        "not base64": "data:image/png;base64,@@@@",
    }
    for what, url in cases.items():
        r = srv.post("/chat/completions", {"model": "qwen2_vl", "messages": chat(1, urls=[url]), "max_tokens": 2},
                     headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400, (what, r.text)
        assert r.json()["error"]["message"], what
    bad_part = [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]
    r = srv.post("/chat/completions", {"model": "qwen2_vl", "messages": bad_part, "max_tokens": 2},
                 headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="qwen2_vl", messages=chat(1, urls=[good]), max_tokens=TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected_text(hf, folder, [make_image(56, 56, seed=5)])
