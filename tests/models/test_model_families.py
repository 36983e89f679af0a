"""The other model families against transformers: Qwen3, GLM-4, Gemma 2 and 3, Granite 3 and GraniteMoE and Llama's
rope scalings (transformers' own classes), and the remote-code
layouts ChatGLM2/3/GLM-4-chat, Qwen (v1) and Baichuan2-7B, written from an equivalent native model (GLM, Qwen2,
Llama; tests/remote_layouts.py) and checked against that model's logits: fp32 teacher-forced logits on every
compute path; greedy tokens alone and batched through the Engine and batched through the session's 2-rank pool,
whose logprobs must equal the reference's log-softmax; bf16 greedy equal to the reference wherever the reference
has no near tie.
Baichuan2-13B (ALiBi) is a different function of the same weights: its reference is baichuan_reference_logits on
the written folder."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import greedy, hf_greedy, installed_on_pool, random_prompt, run_together, serialize, start_engine
from remote_layouts import baichuan_reference_logits, write_baichuan, write_chatglm, write_qwen1
from test_hf_parity import hf_logits, kernels, runner_for, teacher_forced_logits  # noqa: F401 (a fixture)

from allspark_server.loader.tiny_model import build_tiny_model

PROMPT_LEN, DECODE_STEPS = 40, 24


def normalize_head(model) -> None:
    """Baichuan2's NormHead, applied to the reference: each LM-head row divided by its norm."""
    with torch.no_grad():
        w = model.lm_head.weight
        w.copy_(torch.nn.functional.normalize(w.double(), dim=-1).to(w.dtype))


# family -> (native variant, writer of the remote-code layout or None)
FAMILIES = {
    "qwen3": ("qwen3", None),
    "glm": ("glm", None),
    "chatglm": ("glm", write_chatglm),
    "qwen1": ("qwen2_mha", write_qwen1),
    "baichuan2_7b": ("llama_mha", write_baichuan),
    "llama_yarn": ("llama_yarn", None),
    "llama_linear": ("llama_linear", None),
    "llama_dynamic": ("llama_dynamic", None),
    "qwen2_moe": ("qwen2_moe", None),
    "qwen3_moe": ("qwen3_moe", None),
    "mixtral": ("mixtral", None),
    "baichuan2_13b": ("llama_mha", functools.partial(write_baichuan, alibi=True)),
    # sandwich norms, GELU-tanh, soft caps, embeddings scaled; a window of 16 on layer 0 under 20-47-token prompts
    "gemma2": ("gemma2", None),
    # q/k norms, a second rotary table (the sliding layer's own base) beside a linear-scaled one
    "gemma3": ("gemma3", None),
    # embedding, attention, residual and logit multipliers; the MoE's experts in 3-D checkpoint tensors
    "granite": ("granite", None),
    "granitemoe": ("granitemoe", None),
}
# families whose reference is a function of the written folder (ids [1, n] -> logits [1, n, V]), not the source model
FOLDER_REFERENCES = {"baichuan2_13b": baichuan_reference_logits}


# the references' answers, each computed once for the module: the compute paths, the Engine, the pool and bf16 are
# checked against the same prompts (a reference is a fixed function of its model or folder and the tokens)
REFERENCES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def references_forgotten():
    yield
    REFERENCES.clear()


def reference_logits(family: str, folder: str, model, tokens: list[int]) -> torch.Tensor:
    key = ("logits", folder, tuple(tokens))
    if key not in REFERENCES:
        REFERENCES[key] = (FOLDER_REFERENCES[family](folder, torch.tensor([tokens]))[0].float()
                           if family in FOLDER_REFERENCES else hf_logits(model, tokens))
    return REFERENCES[key].clone()


def reference_greedy(family: str, folder: str, model, prompt: list[int], n: int) -> list[int]:
    key = ("greedy", folder, tuple(prompt), n)
    if key not in REFERENCES:
        REFERENCES[key] = _reference_greedy(family, folder, model, prompt, n)
    return list(REFERENCES[key])


def _reference_greedy(family: str, folder: str, model, prompt: list[int], n: int) -> list[int]:
    if family not in FOLDER_REFERENCES:
        return hf_greedy(model, prompt, n)
    ids = list(prompt)
    for _ in range(n):       # the whole sequence again each step: the reference has no cache
        ids.append(int(FOLDER_REFERENCES[family](folder, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (folder our loader reads, the transformers reference model)."""
    out = {}
    for seed, (family, (variant, writer)) in enumerate(FAMILIES.items()):
        src = str(tmp_path_factory.mktemp(variant + "_src"))
        model = build_tiny_model(src, variant, seed=20 + seed, weight_scale=0.08)
        folder = writer(src, str(tmp_path_factory.mktemp(family))) if writer else src
        if family == "baichuan2_7b":
            normalize_head(model)
        out[family] = (folder, model)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_logits_match_the_reference(families, tmp_path, family, kernels):  # noqa: F811 (the fixture)
    folder, model = families[family]
    prompt = random_prompt(PROMPT_LEN, seed=5)
    tokens = prompt + reference_greedy(family, folder, model, prompt, DECODE_STEPS)
    loader = serialize(folder, family, str(tmp_path))
    assert loader.args.architecture == (model.config.architectures[0] if FAMILIES[family][1] is None
                                        else loader.hf_config["architectures"][0])
    ours = teacher_forced_logits(runner_for(loader, family, device=kernels), tokens, PROMPT_LEN)
    ref = reference_logits(family, folder, model, tokens)
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel


def start_all(engine, name: str, prompts: list[list[int]], n: int, logprobs: bool = False) -> list[tuple]:
    """Greedy continuations of all prompts, every request started before any is read (they share decode steps):
    [(tokens, logprob of each token)]. Engine or ClientEngine alike."""
    gen = {"top_k": 1, "max_new_tokens": n, "eos_token_id": [], "logprobs": logprobs}
    return [(tokens, [lp for el in elements for lp in el.token_logprobs_list])
            for tokens, elements in run_together(engine, name, [(p, gen) for p in prompts])]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_through_the_engine_and_a_2_rank_pool(families, pool, tmp_path, family):
    """fp32: greedy tokens equal the reference's alone and batched through the Engine, batched through a 2-rank
    pool; the pool's logprobs of those tokens equal the reference's log-softmax (1e-4 of the logits' range)."""
    folder, model = families[family]
    loader = serialize(folder, family, str(tmp_path))
    prompts = [random_prompt(20 + 7 * i, seed=30 + i) for i in range(3)]
    want = [reference_greedy(family, folder, model, p, 16) for p in prompts]
    engine = start_engine(loader, family)
    try:
        assert [greedy(engine, family, p, 16) for p in prompts] == want
        assert [tokens for tokens, _ in start_all(engine, family, prompts, 16)] == want
    finally:
        engine.shutdown()
    with installed_on_pool(pool[0], loader, family) as client:
        got = start_all(client, family, prompts, 16, logprobs=True)
    assert [tokens for tokens, _ in got] == want
    for p, w, (_, logprobs) in zip(prompts, want, got):
        ref = reference_logits(family, folder, model, p + w)[len(p) - 1:-1].double()
        ref_lp = torch.log_softmax(ref, -1)[torch.arange(len(w)), w]
        assert (torch.tensor(logprobs, dtype=torch.float64) - ref_lp).abs().max() <= 1e-4 * ref.abs().max()


BF16_NEAR_TIE = 0.1   # logits: bf16 weights move these tiny models' logits by up to ~0.04 (measured, transformers bf16)


def assert_greedy_up_to_near_ties(family, folder, model, prompt: list[int], tokens: list[int]) -> None:
    """bf16 greedy against the fp32 reference on our own sequence: each token is the reference's argmax at that
    point, or within BF16_NEAR_TIE of it (a tie at bf16 precision, where either choice is right); the tokens
    before the first near tie equal the reference's own greedy continuation."""
    ref = reference_logits(family, folder, model, prompt + tokens)[len(prompt) - 1:-1].double()
    best = ref.max(-1).values
    chosen = ref[torch.arange(len(tokens)), tokens]
    assert ((best - chosen) <= BF16_NEAR_TIE).all(), (best - chosen).tolist()
    top2 = ref.topk(2, -1).values
    tie_free = int(((top2[:, 0] - top2[:, 1]) > BF16_NEAR_TIE).to(torch.int).cumprod(0).sum())
    assert tokens[:tie_free] == ref.argmax(-1).tolist()[:tie_free]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_greedy_through_the_engine_and_a_2_rank_pool(families, pool, tmp_path, family):
    folder, model = families[family]
    loader = serialize(folder, family, str(tmp_path), dtype="bfloat16")
    prompts = [random_prompt(20 + 7 * i, seed=30 + i) for i in range(3)]
    engine = start_engine(loader, family)
    try:
        alone = [greedy(engine, family, p, 12) for p in prompts]
        batched = [tokens for tokens, _ in start_all(engine, family, prompts, 12)]
    finally:
        engine.shutdown()
    with installed_on_pool(pool[0], loader, family) as client:
        on_pool = [tokens for tokens, _ in start_all(client, family, prompts, 12)]
    for p, *outputs in zip(prompts, alone, batched, on_pool):
        for tokens in outputs:
            assert_greedy_up_to_near_ties(family, folder, model, p, tokens)


def test_dynamic_rope_serves_up_to_its_context_and_says_why_not_past_it(families, tmp_path):
    folder, model = families["llama_dynamic"]
    loader = serialize(folder, "dyn", str(tmp_path))
    context = model.config.max_position_embeddings
    assert loader.get_model_context_length() == context
    from allspark_client import AsException
    from allspark_server import Engine
    engine = Engine()
    cfg = loader.create_reference_runtime_config_builder("dyn", "cpu", [0], max_batch=1).max_length(context + 1).build()
    with pytest.raises(AsException, match=f"dynamic NTK.*max_length <= {context}"):
        engine.install_model(cfg)
    engine.shutdown()


def test_qwen1_serves_up_to_seq_length_where_its_ntk_and_logn_would_act(families, tmp_path):
    """Qwen v1 (use_dynamic_ntk / use_logn_attn on, as released) changes past seq_length: refused there, by name."""
    folder, _ = families["qwen1"]
    loader = serialize(folder, "qwen1", str(tmp_path))
    seq_length = loader.hf_config["seq_length"]
    assert loader.get_model_context_length() == seq_length
    from allspark_client import AsException
    from allspark_server import Engine
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("qwen1", "cpu", [0], max_batch=1)
           .max_length(2 * seq_length).build())
    with pytest.raises(AsException, match=f"past this model's context \\({seq_length} tokens\\), where Qwen's "
                                          f"use_dynamic_ntk and use_logn_attn .*max_length <= {seq_length}"):
        engine.install_model(cfg)
    engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_native_moe_block_equals_its_python_twin_and_a_float64_reference(dtype, rows):
    """native/moe.cpp (the native MoE step after the native norm step) against ops.moe on the same kernels and
    the plain float64 math."""
    from allspark_server.compute import ops, step_ops, steps
    if ops.native() is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(rows)
    h, inter, experts, top_k = 64, 48, 6, 2

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)
    x, residual, norm = rand(rows, h), rand(rows, h), 1 + rand(h)
    weights = dict(router=rand(experts, h), experts=[(rand(2 * inter, h), rand(h, inter)) for _ in range(experts)],
                   top_k=top_k, norm_topk_prob=True, shared=(rand(2 * inter, h), rand(h, inter)),
                   shared_gate=rand(1, h))
    # the layer's pre-MoE norm step (the native NormStep the decode stack runs, bit-equal to ops.rms_norm), then
    # its MoE step
    pre_norm = steps.BoundNorm(steps.Norm("post_attention_layernorm"), norm, 1e-6)
    hn, s = ops.rms_norm(x, norm, 1e-6, residual)
    native_h, native_sum = ops.native().norm_step(x, residual, step_ops.native_step(pre_norm), ops.isa_level())
    assert torch.equal(native_h, hn) and torch.equal(native_sum, s)
    moe = steps.BoundMoe(steps.Moe(num_experts=experts, top_k=top_k, norm_topk_prob=True, shared_expert=True),
                         weights["router"], weights["experts"], weights["shared"], weights["shared_gate"])
    native_out = step_ops.moe_step(hn, moe)
    assert moe.native is not None                                           # it ran native/moe.cpp
    twin = ops.moe(hn, **weights)   # the routing's softmax may differ in the last bit: one rounding of the output
    assert ((native_out.double() - twin.double()).abs().max()
            <= (2e-6 if dtype == torch.float32 else 1e-2) * twin.abs().max())
    # float64: route, run the chosen experts, add the gated shared expert
    d = {k: (v.double() if torch.is_tensor(v) else v) for k, v in weights.items()}
    hd = hn.double()
    probs = torch.softmax(hd @ d["router"].T, -1)
    want = torch.zeros(rows, h, dtype=torch.float64)
    for r in range(rows):
        top = probs[r].topk(top_k)
        for p, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            gu, down = (w.double() for w in weights["experts"][e])
            a = hd[r] @ gu.T
            want[r] += p * ((torch.nn.functional.silu(a[:inter]) * a[inter:]) @ down.T)
        gu, down = (w.double() for w in weights["shared"])
        a = hd[r] @ gu.T
        want[r] += (torch.sigmoid(hd[r] @ d["shared_gate"].T)
                    * ((torch.nn.functional.silu(a[:inter]) * a[inter:]) @ down.T))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (native_out.double() - want).abs().max().item() <= tol * want.abs().max().item()


def _copy_folder(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if edit_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    if edit_tensors:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    return str(dst)


def test_malformed_folders_are_refused_naming_the_architecture_key_or_tensor(families, tmp_path):
    from allspark_server import HuggingFaceModel
    from allspark_server.loader.hf_model import ModelSerializerException
    chatglm, _ = families["chatglm"]
    qkv = "transformer.encoder.layers.1.self_attention.query_key_value.weight"
    cases = [
        (lambda c: c.pop("padded_vocab_size"), None, "ChatGLMModel: config.json lacks the key 'padded_vocab_size'"),
        (lambda c: c.update(rmsnorm=False), None, "ChatGLMModel with rmsnorm=False is not supported"),
        (lambda c: c.update(architectures=["GPTNeoXForCausalLM"]), None, "'GPTNeoXForCausalLM' is not supported"),
        (None, lambda t: t.pop(qkv), r"lacks tensors .*model\.layers\.1\.self_attn\.q_proj\.weight"),
        (None, lambda t: t.update({qkv: t[qkv][:-16]}), f"tensor '{qkv}'.*rows; the config implies"),
        (None, lambda t: t.update(extra=t[qkv].clone()), "unexpected tensor 'extra' for ChatGLMModel"),
    ]
    for i, (cfg, tensors, message) in enumerate(cases):
        folder = _copy_folder(chatglm, tmp_path / str(i), cfg, tensors)
        with pytest.raises(ModelSerializerException, match=message):
            HuggingFaceModel(folder, "bad", user_set_data_type="float32").load_model()
    llama, _ = families["llama_yarn"]
    folder = _copy_folder(llama, tmp_path / "rope",
                          lambda c: c.update(rope_parameters={"rope_type": "su", "factor": 2, "rope_theta": 10000.0}))
    with pytest.raises(ModelSerializerException, match="rope type 'su'.*not supported; supported: default"):
        HuggingFaceModel(folder, "bad")


def test_gemma2_window_caps_and_norm_offsets_each_change_the_reference(families):
    """The gemma2 family's tests prove each Gemma feature only if dropping it changes transformers' own logits on
    their prompts: the sliding window (prompts longer than it), both soft caps, and the norms' (1 + weight)."""
    _, model = families["gemma2"]
    tokens = random_prompt(PROMPT_LEN, seed=5)
    base = hf_logits(model, tokens)
    assert len(tokens) > model.config.sliding_window
    variants = {"sliding_window": dict(sliding_window=4096),
                "attn_logit_softcapping": dict(attn_logit_softcapping=None),
                "final_logit_softcapping": dict(final_logit_softcapping=None)}
    for what, change in variants.items():
        saved = {k: getattr(model.config, k) for k in change}
        for k, v in change.items():
            setattr(model.config, k, v)
        for layer in model.model.layers:          # the attention modules copied these at construction
            layer.self_attn.sliding_window = (
                model.config.sliding_window
                if model.config.layer_types[layer.self_attn.layer_idx] == "sliding_attention" else None)
            layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
        try:
            changed = hf_logits(model, tokens)
        finally:
            for k, v in saved.items():
                setattr(model.config, k, v)
            for layer in model.model.layers:
                layer.self_attn.sliding_window = (model.config.sliding_window
                                                  if model.config.layer_types[layer.self_attn.layer_idx]
                                                  == "sliding_attention" else None)
                layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
        assert (changed - base).abs().max() > 1e-2 * base.abs().max(), what
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert all(p.abs().max() > 0.05 for p in norms)          # 1 + w differs from 1 (and from w) everywhere
