"""Speculative decoding through the Engine (allspark_server/speculative/): greedy output token for token as without
it for several families in fp32 and bf16, alone and batched, under preemption and after prefix-cache hits;
penalties, min_length, stop words, logprobs and max_length as without it; seeded sampling reproducible; the
per-request switch, the requests that never speculate, and the stats."""
from __future__ import annotations

import pytest
from helpers import generate, random_prompt, run_together, serialize, start_engine

from allspark_server.loader.tiny_model import build_tiny_model
from allspark_server.step.kv_cache import bytes_per_span

GREEDY = {"top_k": 1, "eos_token_id": []}


def repeating_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a run of their own tokens, so that prompt lookup has something to find."""
    out = []
    for i in range(count):
        p = random_prompt(36, seed + i)
        out.append(p + p[4:24] + p[:8])
    return out


def engine_pair(hf_dir: str, tmp, dtype: str = "float32", **engine_kw):
    """(an Engine without speculation, one with ngram speculation of 4 tokens) serving the same files as 'm'."""
    loader = serialize(hf_dir, "m", str(tmp / f"as-{dtype}"), dtype=dtype)
    base = start_engine(loader, "m", max_batch=4, max_length=512, **engine_kw)
    spec = start_engine(loader, "m", max_batch=4, max_length=512, speculative=("ngram", 4), **engine_kw)
    return base, spec


@pytest.mark.parametrize("variant, dtype", [("llama_gqa_llama3", "float32"), ("llama_gqa_llama3", "bfloat16"),
                                            ("qwen2_bias_tied", "bfloat16"), ("gemma2", "float32"),
                                            ("qwen3", "bfloat16"), ("granite", "float32")])
def test_greedy_equals_greedy_without_speculation(variant, dtype, tiny_models, tmp_path):
    if variant in tiny_models:
        hf_dir = tiny_models[variant].hf_dir
    else:
        hf_dir = str(tmp_path / variant)
        build_tiny_model(hf_dir, variant)
    base, spec = engine_pair(hf_dir, tmp_path, dtype)
    gen = {**GREEDY, "max_new_tokens": 70}
    prompts = repeating_prompts(4, seed=11)
    want = [generate(base, "m", p, gen)[0] for p in prompts]
    assert [generate(spec, "m", p, gen)[0] for p in prompts] == want
    assert [t for t, _ in run_together(spec, "m", [(p, gen) for p in prompts[:3]])] == want[:3]
    stat = spec.get_as_engine_stat("m")
    assert stat.spec_verify_steps > 0 and 0 < stat.spec_accepted_tokens <= stat.spec_draft_tokens, stat
    assert stat.spec_emitted_tokens == stat.spec_accepted_tokens + stat.spec_verify_steps


@pytest.fixture(scope="module")
def llama_pair(tiny_models, tmp_path_factory):
    return engine_pair(tiny_models["llama_gqa_llama3"].hf_dir, tmp_path_factory.mktemp("spec"))


@pytest.mark.parametrize("gen", [
    {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2},
    {"min_length": 90, "eos_token_id": [7, 9, 11, 13, 15, 17, 19, 21, 23, 25]},
    {"logprobs": True, "top_logprobs": 3},
    {"max_new_tokens": 9},
    # bans tokens the prompts repeat (what prompt lookup proposes), so verify rows must see the bias
    {"logit_bias": {t: -100 for t in repeating_prompts(2, seed=3)[0][4:12]} | {7: 4.0}},
], ids=["penalties", "min_length", "logprobs", "max_new_tokens", "logit_bias"])
def test_generation_options_behave_as_without_speculation(gen, llama_pair):
    base, spec = llama_pair
    gen = {**GREEDY, "max_new_tokens": 60, **gen}
    for p in repeating_prompts(2, seed=3):
        (want, want_el), (got, got_el) = generate(base, "m", p, gen), generate(spec, "m", p, gen)
        assert got == want
        if gen.get("logprobs"):
            lp = [x for el in want_el for x in el.token_logprobs_list]
            assert [x for el in got_el for x in el.token_logprobs_list] == pytest.approx(lp, abs=1e-5)
            tops = [t for el in got_el for t in el.log_probs_list]
            assert [[i for i, _ in t] for t in tops] == [[i for i, _ in t] for el in want_el for t in el.log_probs_list]


def test_stop_words_end_where_they_would_without_speculation(llama_pair):
    base, spec = llama_pair
    p = repeating_prompts(1, seed=5)[0]
    full = generate(base, "m", p, {**GREEDY, "max_new_tokens": 60})[0]
    stop = full[30:32]                                     # a pair met mid-way, maybe inside an accepted run
    gen = {**GREEDY, "max_new_tokens": 60, "stop_words_ids": [stop]}
    want = generate(base, "m", p, gen)[0]
    assert generate(spec, "m", p, gen)[0] == want and len(want) <= 32


def test_seeded_sampling_repeats_and_the_switch_and_stats(llama_pair):
    base, spec = llama_pair
    p = repeating_prompts(1, seed=8)[0]
    sampled = {"temperature": 0.7, "top_k": 20, "seed": 99, "max_new_tokens": 50, "eos_token_id": []}
    assert generate(spec, "m", p, sampled)[0] == generate(spec, "m", p, sampled)[0]
    before = spec.get_as_engine_stat("m")
    off = generate(spec, "m", p, {**GREEDY, "max_new_tokens": 40, "speculative": False})[0]
    after = spec.get_as_engine_stat("m")
    assert off == generate(base, "m", p, {**GREEDY, "max_new_tokens": 40})[0]
    assert after.spec_draft_tokens == before.spec_draft_tokens and "turned_off=1" in after.spec_skipped
    guided = {**GREEDY, "max_new_tokens": 20, "response_format": {"type": "regex", "regex": "[a-z ]+"}}
    generate(spec, "m", p, guided)
    assert "response_format=1" in spec.get_as_engine_stat("m").spec_skipped


def test_preemption_and_prefix_cache_hits_keep_greedy_output(llama, tmp_path):
    """A KV cache of 14 spans of 16 tokens for 4 requests of ~150 tokens each: requests are preempted and recomputed
    (from the prefix cache where their spans survive), proposals and rollbacks on the way."""
    loader = serialize(llama.hf_dir, "m", str(tmp_path / "as"))
    args = loader.args
    budget = 14 * bytes_per_span(args.num_layers, 16, args.num_kv_heads, args.head_dim, loader.data_type)
    base, spec = engine_pair(llama.hf_dir, tmp_path, kv_bytes=budget)
    gen = {**GREEDY, "max_new_tokens": 90}
    prompts = repeating_prompts(4, seed=21)
    want = [generate(base, "m", p, gen)[0] for p in prompts]
    assert [t for t, _ in run_together(spec, "m", [(p, gen) for p in prompts])] == want
    assert [generate(spec, "m", prompts[0], gen)[0] for _ in range(2)] == [want[0]] * 2   # the second hits
    stat = spec.get_as_engine_stat("m")
    assert stat.num_preempted > 0 and stat.prefix_cache_hit_token > 0 and stat.spec_accepted_tokens > 0, stat
