"""logit_bias through the Engine on the tiny Llama: greedy output equals transformers' greedy loop over logits + bias
(fp32), its logprobs the log-softmax of logits + bias; -100 bans tokens from a long sampled run, +100 forces a token
greedy and sampled; biased and unbiased requests sharing steps each get what they get alone; a bad bias is a
PARAM_ERROR naming logit_bias.
"""
from __future__ import annotations

import pytest
import torch
from helpers import generate, hf_logits, hf_loop, random_prompt, run_together

from allspark_client import AsStatus


def _bias_ref(bias: dict):
    def process(_ids, _out, logits):
        logits = logits.clone()
        for t, b in bias.items():
            logits[t] += b
        return logits
    return process


def test_greedy_follows_hf_logits_plus_bias(served_llama, llama):
    engine, _ = served_llama
    prompt = random_prompt(10, 71)
    raw = hf_logits(llama.model, prompt)[-1]
    order = torch.argsort(raw, descending=True).tolist()
    # ban the raw favourite, nudge the third and tenth ones: the first token moves, and the later ones with it
    bias = {order[0]: -100.0, order[2]: 1.5, order[9]: 3.0}
    first = int((raw + torch.tensor([bias.get(i, 0.0) for i in range(raw.numel())], dtype=raw.dtype)).argmax())
    assert first != order[0]
    ref = hf_loop(llama.model, prompt, 12, _bias_ref(bias), dtype=torch.float32)
    plain = hf_loop(llama.model, prompt, 12, lambda ids, out, lg: lg, dtype=torch.float32)
    assert ref[0] == first and ref != plain
    gen = {"top_k": 1, "max_new_tokens": 12, "eos_token_id": [], "logit_bias": bias}
    tokens, elements = generate(engine, "llama", prompt, gen)
    assert tokens == ref
    assert order[0] not in tokens
    # logprobs are those of the biased distribution
    tokens, elements = generate(engine, "llama", prompt, dict(gen, max_new_tokens=4, logprobs=True, top_logprobs=2))
    lps = [x for el in elements for x in el.token_logprobs_list]
    full = hf_logits(llama.model, prompt + tokens[:-1])[len(prompt) - 1:]
    for i, tok in enumerate(tokens):
        want = torch.log_softmax(_bias_ref(bias)(None, None, full[i]), -1)
        assert lps[i] == pytest.approx(float(want[tok]), abs=1e-4)


def test_plus_100_forces_greedy_and_sampled(served_llama):
    engine, _ = served_llama
    prompt = random_prompt(8, 72)
    forced = 123
    for gen in ({"top_k": 1}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.5, "top_p": 0.9, "seed": 6}):
        tokens, _ = generate(engine, "llama", prompt, {**gen, "max_new_tokens": 8, "eos_token_id": [],
                                                       "logit_bias": {forced: 100}})
        assert tokens == [forced] * 8, gen


def test_minus_100_bans_in_a_sampled_run(served_llama):
    """A hot sampled run of 64 tokens, then again with every token it produced banned: none of them comes back, and
    a request without the bias sharing its steps still gets its own output."""
    engine, _ = served_llama
    prompt = random_prompt(8, 73)
    gen = {"temperature": 1.5, "seed": 9, "max_new_tokens": 64, "eos_token_id": []}
    first, _ = generate(engine, "llama", prompt, gen)
    banned = {t: -100 for t in set(first)}
    assert len(banned) > 20
    greedy = {"top_k": 1, "max_new_tokens": 64, "eos_token_id": []}
    alone_greedy, _ = generate(engine, "llama", prompt, greedy)
    biased_greedy, _ = generate(engine, "llama", prompt, dict(greedy, logit_bias=banned))
    (sampled, _), (plain, _), (bg, _) = run_together(engine, "llama", [
        (prompt, dict(gen, logit_bias=banned)), (prompt, greedy), (prompt, dict(greedy, logit_bias=banned))])
    assert len(sampled) == 64 and not set(sampled) & set(banned)
    assert plain == alone_greedy
    assert bg == biased_greedy and not set(bg) & set(banned)
    alone_sampled, _ = generate(engine, "llama", prompt, dict(gen, logit_bias=banned))
    assert sampled == alone_sampled


@pytest.mark.parametrize("bias, needle", [({512: 1.0}, "logit_bias keys must be token ids in [0, 512)"),
                                          ({3: -101}, "logit_bias[3]"), ({"3": 1}, "logit_bias keys")])
def test_bad_bias_is_param_error(served_llama, llama, bias, needle):
    engine, _ = served_llama
    if "512" in needle:
        vocab = llama.model.config.vocab_size
        bias, needle = {vocab: 1.0}, f"logit_bias keys must be token ids in [0, {vocab})"
    status, handle, _ = engine.start_request("llama", {"input_ids": [5, 6, 7]},
                                             {"max_new_tokens": 2, "logit_bias": bias})
    assert status == AsStatus.ALLSPARK_PARAM_ERROR and handle is None
    assert needle in engine.get_last_error()
