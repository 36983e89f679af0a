"""OpenAI tool calling through allspark-serve (issue 51), with the official `openai` client: on a tiny random model
of each parser's family with a chat template written in that family's style (Qwen/Hermes, Llama 3.x JSON, Mistral,
GLM-4), forced calls (tool_choice required / named) whose arguments validate against their schemas (jsonschema)
over 50 random schemas, streamed tool-call deltas that reassemble to the non-streamed call, the prompt of a
conversation with tools, calls and results as long as transformers' apply_chat_template makes it, and bad tool
definitions answered with OpenAI-shaped 400s."""
from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from http_helpers import Server
from json_schemas import SCHEMAS

QWEN = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nAnswer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
LLAMA3 = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\nRespond with a function call as {\"name\": function "
    "name, \"parameters\": dictionary of argument name and its value}. Functions:\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n<|python_tag|>{% for c in m.tool_calls %}{\"name\": "
    "\"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n{{ m.content }}<|eot_id|>{%- endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}")
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}[INST]{{ m.content }}[/INST]{%- elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]{%- elif m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- else %}{{ m.content }}</s>{% endif %}{% endfor %}")
GLM4 = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}## {{ t.function.name }}\n"
    "{{ t.function | tojson }}\n{% endfor %}{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|observation|>\n{{ m.content }}{%- elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
    "{{ c.function.name }}\n{{ c.function.arguments | tojson }}{% endfor %}{%- else %}<|{{ m.role }}|>\n"
    "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# family -> (tiny variant, chat template); the parser is chosen from the template's call syntax
FAMILIES = {"hermes": ("qwen3", QWEN), "llama3_json": ("llama_gqa_llama3", LLAMA3), "mistral": ("llama_mha", MISTRAL),
            "glm4": ("glm", GLM4)}
MAX_LENGTH = 2048

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


def family_folder(name: str, root: str) -> str:
    """The family's tiny model with its chat template."""
    from allspark_server.loader.tiny_model import build_tiny_model
    variant, template = FAMILIES[name]
    hf_dir = f"{root}/{variant}"
    build_tiny_model(hf_dir, variant, seed=3, weight_scale=0.2)
    path = f"{hf_dir}/tokenizer_config.json"
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f)
    return hf_dir


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """family -> its allspark-serve, the four started at once (a start is seconds of a process's own imports and
    loading, which overlap); all stopped at the module's end."""
    folders = {name: family_folder(name, str(tmp_path_factory.mktemp(f"tools-{name}"))) for name in FAMILIES}
    with ThreadPoolExecutor(len(folders)) as starter:
        starts = {name: starter.submit(Server, hf_dir, "--max-length", str(MAX_LENGTH), "--max-batch", "8")
                  for name, hf_dir in folders.items()}
    started, failed = {}, None
    for name, start in starts.items():
        try:
            started[name] = start.result()
        except Exception as e:
            failed = failed or e
    try:
        if failed is not None:
            raise failed
        for name, srv in started.items():
            srv.family, srv.hf_dir = name, folders[name]
        yield started
    finally:
        for srv in started.values():
            srv.stop()
        for hf_dir in folders.values():
            shutil.rmtree(hf_dir, ignore_errors=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, servers):
    return servers[request.param]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


def stream_calls(stream) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) reassembled from streamed chunks as OpenAI documents it."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            if d.id is not None:                          # the first delta of a call: id, type, name
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_call_whole_and_streamed_then_a_round_trip(family):
    from transformers import AutoTokenizer
    client = client_of(family)
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = dict(model="llama", messages=CONVERSATION[:2], tools=[CLOCK, WEATHER], tool_choice=named, max_tokens=120,
               temperature=0)
    r = client.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice, family.log())
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema_of(WEATHER))
    content, calls, finish = stream_calls(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and (content or None) == choice.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    # the result goes back: the prompt is the template's rendering of tools, call and result (transformers' own)
    history = CONVERSATION[:2] + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r2 = client.chat.completions.create(model="llama", messages=history, tools=[CLOCK, WEATHER], max_tokens=8,
                                        temperature=0)
    tok = AutoTokenizer.from_pretrained(family.hf_dir)
    ref_history = [dict(m) for m in history]
    ref_history[2] = {"role": "assistant", "content": None, "tool_calls": [
        {**call.model_dump(), "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}
    want = tok.apply_chat_template([{k: v for k, v in m.items() if v is not None} for m in ref_history],
                                   tools=[CLOCK, WEATHER], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert r2.usage.prompt_tokens == len(want)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_picks_one_of_the_tools(family):
    client = client_of(family)
    r = client.chat.completions.create(model="llama", messages=CONVERSATION[:2], tools=[WEATHER, CLOCK],
                                       tool_choice="required", max_tokens=120, temperature=0.8, seed=5)
    (call,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema_of(tool))


def test_auto_and_none_answer_text(family):
    """The random model writes no call of its own (nothing forces one): the answer is its text, as without tools;
    tool_choice none renders no tools at all."""
    client = client_of(family)
    plain = client.chat.completions.create(model="llama", messages=CONVERSATION[:2], max_tokens=8, temperature=0)
    none = client.chat.completions.create(model="llama", messages=CONVERSATION[:2], tools=[WEATHER],
                                          tool_choice="none", max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and not none.choices[0].message.tool_calls
    auto = client.chat.completions.create(model="llama", messages=CONVERSATION[:2], tools=[WEATHER], max_tokens=8,
                                          temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens           # the template listed the tools
    if not auto.choices[0].message.tool_calls:
        assert auto.choices[0].finish_reason in ("stop", "length")
        content, calls, _ = stream_calls(client.chat.completions.create(
            model="llama", messages=CONVERSATION[:2], tools=[WEATHER], max_tokens=8, temperature=0, stream=True))
        assert content == auto.choices[0].message.content and not calls


_PARAMS = [s for _, s in SCHEMAS if s.get("type") == "object" and "$defs" not in s and "allOf" not in s]


def random_schemas(n: int, seed: int) -> list[dict]:
    """n object schemas, each the properties of 1-3 of json_schemas.py's object schemas under new names (every
    value bounded, so any admitted output is short)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        props = {}
        for k, base in enumerate(rng.sample(_PARAMS, rng.randint(1, 3))):
            for name, sub in base["properties"].items():
                props[f"{name}_{k}"] = sub
        required = [p for p in props if rng.random() < 0.7]
        out.append({"type": "object", "properties": props, "required": required, "additionalProperties": False})
    return out


def test_forced_calls_match_fifty_random_schemas(family):
    """50 random tools, each forced (named, or required among it and a decoy, get_time), 50 requests at once: every
    call parses and validates against its tool's schema."""
    n = 50 if family.family == "hermes" else 8
    schemas = random_schemas(n, seed=len(family.family))
    client = client_of(family)

    def one(i):
        tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": schemas[i]}}
        choice = "required" if i % 2 else {"type": "function", "function": {"name": f"tool_{i}"}}
        r = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": f"call {i}"}],
                                           tools=[tool, CLOCK] if i % 2 else [CLOCK, tool], tool_choice=choice,
                                           max_tokens=400, temperature=1.0, seed=i)
        return r.choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, range(n)))
    names = []
    for i, c in enumerate(choices):
        assert c.finish_reason == "tool_calls", (i, c)
        (call,) = c.message.tool_calls
        names.append(call.function.name)
        schema = schema_of(CLOCK) if call.function.name == "get_time" else schemas[i]
        assert call.function.name in (f"tool_{i}", "get_time" if i % 2 else None)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert names.count("get_time") < n // 2          # the named half never picks the decoy


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None,
     "tools[0].function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
])
@pytest.mark.parametrize("family", ["hermes"], indirect=True)     # validation does not depend on the family
def test_bad_tools_are_openai_400s(family, tools, choice, param):
    client = client_of(family)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="llama", messages=CONVERSATION[:2], tools=tools,
                                       **({"tool_choice": choice} if choice else {}), max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["param"] == param and e.value.body["type"] == \
        "invalid_request_error"
