"""Tool calling's pure parts (allspark_server/http/tools/): tool definitions and tool_choice validated as OpenAI
does (bad schemas checked against jsonschema's meta-schema), each family's call syntax parsed whole and streamed
(the streamed pieces, fed a character or a few at a time, reassemble to the hand-written calls), the forcing
grammars accepted by llguidance, and what a chat template receives."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from allspark_server.http import tools as t
from allspark_server.http.protocol import ApiError, parse_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}},
                                                 "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tool(name, parameters=None):
    fn = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# ---- validation ------------------------------------------------------------------------------------------------
def test_valid_tools_become_specs():
    specs = t.validate_tools([WEATHER, TIME])
    assert [s.name for s in specs] == ["get_weather", "get_time"]
    assert specs[0].parameters == WEATHER["function"]["parameters"]
    assert specs[1].parameters == {"type": "object", "properties": {}}
    assert specs[0].description == "Weather of a city"


@pytest.mark.parametrize("schema", [{"type": "objekt"}, {"type": "object", "properties": {"a": {"type": 5}}},
                                    {"type": "object", "required": "city"}, {"minimum": "zero"}])
def test_invalid_schema_is_named(schema):
    with pytest.raises(jsonschema.SchemaError):          # the reference: jsonschema's own meta-schema check
        jsonschema.Draft202012Validator.check_schema(schema)
    with pytest.raises(t.ToolError) as e:
        t.validate_tools([WEATHER, tool("bad", schema)])
    assert e.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize("tools, param", [
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([tool("has space")], "tools[0].function.name"),
    ([tool("x" * 65)], "tools[0].function.name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parametres": {}}}], "tools[0].function"),
    ([tool("f", "not a schema")], "tools[0].function.parameters"),
])
def test_bad_tools_are_named(tools, param):
    with pytest.raises(t.ToolError) as e:
        t.validate_tools(tools)
    assert e.value.param == param


def test_tool_choice():
    specs = t.validate_tools([WEATHER, TIME])
    assert t.parse_tool_choice(None, specs) == t.ToolChoice("auto")
    assert t.parse_tool_choice(None, []) == t.ToolChoice("none")
    assert t.parse_tool_choice("required", specs) == t.ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert t.parse_tool_choice(named, specs) == t.ToolChoice("named", "get_time")
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 3):
        with pytest.raises(t.ToolError):
            t.parse_tool_choice(bad, specs)
    with pytest.raises(t.ToolError):
        t.parse_tool_choice("required", [])


def chat_body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_chat_request_errors_are_openai_400s():
    for body, param in [(chat_body(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
                        (chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                         "tool_choice.function.name"),
                        (chat_body(tools=[WEATHER], tool_choice="required",
                                   response_format={"type": "json_object"}), "tool_choice"),
                        (chat_body(messages=[{"role": "user", "content": "a", "tool_calls": []}]),
                         "messages[0].tool_calls"),
                        (chat_body(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]),
                         "messages[0].tool_calls[0]")]:
        with pytest.raises(ApiError) as e:
            parse_chat(body, "m")
        assert e.value.status == 400 and e.value.param == param, (body, e.value.body())


def test_chat_request_with_tool_history():
    req = parse_chat(chat_body(tools=[WEATHER], tool_choice="auto", messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]), "m")
    assert req.tool_choice == t.ToolChoice("auto") and [s.name for s in req.tools] == ["get_weather"]
    msgs = t.template_messages(req.messages)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}   # a dict, as templates expect
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


# ---- parsers ---------------------------------------------------------------------------------------------------
ARGS1 = '{"city": "Paris", "days": [1, {"a": "}\\"{"}]}'
ARGS2 = '{}'
CASES = {   # parser -> (text, content, [(name, arguments)])
    "hermes": [
        (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS1}}}\n</tool_call>\n'
         f'<tool_call>\n{{"name": "get_time", "arguments": {ARGS2}}}\n</tool_call>',
         "Let me check.", [("get_weather", ARGS1), ("get_time", ARGS2)]),
        (f'<tool_call>{{"arguments": {ARGS1}, "name": "get_weather"}}</tool_call>', "", [("get_weather", ARGS1)]),
        ("no call here < tool_call >", "no call here < tool_call >", []),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {ARGS1}}}', "", [("get_weather", ARGS1)]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS1}}}; {{"name": "get_time", "parameters": {{}}}}',
         "", [("get_weather", ARGS1), ("get_time", "{}")]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("The answer is 42.", "The answer is 42.", []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS1}}}, {{"name": "get_time", "arguments": {{}}}}]',
         "", [("get_weather", ARGS1), ("get_time", "{}")]),
        (f"Sure.[TOOL_CALLS]get_weather[ARGS]{ARGS1}[TOOL_CALLS]get_time[ARGS]{{}}", "Sure.",
         [("get_weather", ARGS1), ("get_time", "{}")]),
        ("Just text [TOOL", "Just text [TOOL", []),
    ],
    "glm4": [
        (f"get_weather\n{ARGS1}", "", [("get_weather", ARGS1)]),
        ("Hello there\n{}", "Hello there\n{}", []),
        ("unknown_tool\n{}", "unknown_tool\n{}", []),
    ],
}


def reassemble(events):
    text, calls = "", []
    for e in events:
        if isinstance(e, t.TextDelta):
            text += e.text
        elif isinstance(e, t.ToolCallStart):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls.append([e.name, ""])
        else:
            calls[e.index][1] += e.arguments
    return text, [tuple(c) for c in calls]


@pytest.mark.parametrize("name, case", [(n, c) for n, cs in CASES.items() for c in cs])
def test_parser_whole_and_streamed(name, case):
    text, content, calls = case
    parser = t.PARSERS[name](["get_weather", "get_time"])
    got_content, got_calls = parser.parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)
    rng = random.Random(len(text))
    for step in (1, 3, None):                   # a character, three, random pieces at a time
        s = parser.stream()
        events, i = [], 0
        while i < len(text):
            n = step or rng.randint(1, 8)
            events += s.feed(text[i:i + n])
            i += n
        events += s.finish()
        assert reassemble(events) == (content, calls), (step, events)


def test_parser_choice():
    assert t.parser_for("{{ '<tool_call>' }}").name == "hermes"
    assert t.parser_for("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert t.parser_for("<|python_tag|>").name == "llama3_json"
    assert t.parser_for("<|observation|>").name == "glm4"
    assert t.parser_for(None).name == "hermes"
    assert t.parser_for("<tool_call>", "glm4").name == "glm4"
    with pytest.raises(ValueError):
        t.parser_for(None, "nope")


def test_a_call_cut_short_is_text_whole_and_a_started_call_streamed():
    """Whole, a call cut short (max_tokens) is text; streamed, it went out as a call before it was cut (events are
    never taken back): its arguments so far."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1'
    parser = t.PARSERS["hermes"]()
    assert parser.parse(text) == (text, [])
    s = parser.stream()
    events = [e for ch in text for e in s.feed(ch)] + s.finish()
    assert reassemble(events) == ("", [("f", '{"a": 1')])


# ---- grammars --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", list(t.PARSERS))
def test_forcing_grammars_compile_and_parse_back(parser):
    """Each grammar is valid Lark for llguidance and a text it admits (checked with llguidance's matcher,
    independent of our parser) parses back to the forced call."""
    from llguidance import LLMatcher
    specs = t.validate_tools([WEATHER, TIME])
    g = t.tool_grammar(specs, t.ToolChoice("named", "get_weather"), parser)
    assert t.tool_grammar(specs, t.ToolChoice("none"), parser) is None
    tok = _byte_tokenizer()
    grammar = LLMatcher.grammar_from_lark(g)
    is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar, tok)
    assert not is_error, msgs
    before = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": ',
              "llama3_json": '{"name": "get_weather", "parameters": ',
              "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ', "glm4": "get_weather\n"}[parser]
    after = {"hermes": "}\n</tool_call>", "llama3_json": "}", "mistral": "}]", "glm4": ""}[parser]
    text = before + '{"city": "Oslo", "days": 3}' + after
    m = LLMatcher(tok, grammar)
    assert m.consume_tokens(list(text.encode())), m.get_error()
    assert m.is_accepting()
    bad = LLMatcher(tok, grammar)
    assert not bad.consume_tokens(list((before + '{"days": 3}').encode())) or not bad.is_accepting()
    content, calls = t.PARSERS[parser](["get_weather", "get_time"]).parse(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 3})]


class _ByteTokenizer:
    """A tokenizer of one token per byte, EOS 256 and a special token [TOOL_CALLS] 257 (llguidance writes a
    special token's bytes after 0xFF), as llguidance's TokenizerWrapper takes one."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>", b"\xff[TOOL_CALLS]"]
    special_token_ids = [256, 257]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


def _byte_tokenizer():
    import llguidance
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _accepts(grammar_lark: str, tokens: list[int]) -> bool:
    from llguidance import LLMatcher
    m = LLMatcher(_byte_tokenizer(), LLMatcher.grammar_from_lark(grammar_lark))
    return m.consume_tokens(tokens) and m.is_accepting()


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'


def test_auto_constrains_a_call_once_its_marker_is_written():
    """Hermes `auto`: any text, and calls after <tool_call> must name a tool and match its schema (llguidance's
    matcher decides, byte by byte)."""
    specs = t.validate_tools([WEATHER, TIME])
    g = t.tool_grammar(specs, t.ToolChoice("auto"), "hermes")
    free = "Any text at all, {braces} and <tags> too.\n"
    assert _accepts(g, list(free.encode()))
    assert _accepts(g, list((free + "<tool_call>\n" + CALL + "\n</tool_call> more text").encode()))
    assert not _accepts(g, list((free + '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>').encode()))
    assert not _accepts(g, list((free + '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}'
                                        "\n</tool_call>").encode()))
    assert t.tool_grammar(specs, t.ToolChoice("auto"), "llama3_json") is None   # no marker: nothing to wait for


def test_a_special_token_marker_is_written_as_that_token():
    """Mistral's [TOOL_CALLS] as a special token (id 257): the grammars ask for the token, not its spelling."""
    specs = t.validate_tools([WEATHER])
    body = list(("[" + CALL + "]").encode())
    for choice in (t.ToolChoice("auto"), t.ToolChoice("required")):
        g = t.tool_grammar(specs, choice, "mistral", {"[TOOL_CALLS]": 257})
        assert _accepts(g, ([] if choice.mode == "required" else list(b"Sure. ")) + [257] + body)
        # forced, the spelling is refused; in auto it is mere text (the special token alone opens a call)
        assert _accepts(g, list(b"[TOOL_CALLS]") + body) == (choice.mode == "auto")


# ---- template input --------------------------------------------------------------------------------------------
def test_template_without_tools_gets_a_system_prompt():
    specs = t.validate_tools([WEATHER])
    from allspark_server.http.tools.template import with_tools_prompt
    msgs = with_tools_prompt([{"role": "user", "content": "hi"}], specs)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert not t.template_uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert t.template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


def test_a_template_without_tools_gets_the_history_as_text():
    """A template that reads no `tools`: the user's system message is kept (the tools' description in front of it
    unless tool_choice is none), calls and results become Hermes text a plain template renders."""
    from allspark_server.http.tools.chat import ServerTools

    class Tok:
        added_tokens_decoder = {}
    server = ServerTools(Tok(), "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert server.parser_name == "hermes"
    history = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "42"}]
    specs = t.validate_tools([TIME])
    for mode in ("none", "auto"):
        msgs, tools = server.template_input(history, specs, t.ToolChoice(mode))
        assert tools is None and [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
        assert msgs[0]["content"].endswith("Be nice.") and ("get_time" in msgs[0]["content"]) == (mode == "auto")
        assert msgs[2]["content"] == '<tool_call>{"name": "get_time", "arguments": {"a": 1}}</tool_call>'
        assert msgs[3]["content"] == "<tool_response>\n42\n</tool_response>"
