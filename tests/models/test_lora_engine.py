"""LoRA adapters through the Engine: greedy output against transformers + PEFT (each adapter on its own) for three
adapters of ranks 8, 16 and 64, alone and mixed in one batch with base-model requests, fp32 and bf16 (the families'
rule: each token the reference's argmax or within a near tie of it); the prefix cache never hands one adapter's K/V
to another; and every LoRA status code where DashInfer returns it, the engine serving on after each."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import LONG_RUN_TOKENS, collect, generate, hf_greedy, random_prompt, run_together, serialize
from lora_cases import make_adapter, make_base

from allspark_client import GenerateRequestStatus
from allspark_client.types import AsStatus
from allspark_server import Engine, TargetDevice

RANKS = {"ad8": 8, "ad16": 16, "ad64": 64}
BF16_NEAR_TIE = 0.1   # as tests/models/test_model_families.py: bf16 weights move these tiny models' logits ~0.04


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base_dir = str(root / "base")
    base = make_base(base_dir)
    adapters = {name: make_adapter(base_dir, str(root / name), name, rank, seed=20 + i)
                for i, (name, rank) in enumerate(RANKS.items())}
    loaders = {dtype: serialize(base_dir, "m", str(root / dtype), dtype) for dtype in ("float32", "bfloat16")}
    return base, adapters, loaders, root


def start(loader, max_num: int = 3, max_rank: int = 64, max_batch: int = 16, max_length: int = 512) -> Engine:
    engine = Engine()
    b = loader.create_reference_runtime_config_builder("m", TargetDevice.CPU, [0], max_batch=max_batch)
    b.max_length(max_length).kv_cache_span_size(16).lora_max_num(max_num).lora_max_rank(max_rank)
    engine.install_model(b.build())
    engine.start_model("m")
    return engine


def gen(n: int, lora: str = "") -> dict:
    out = {"top_k": 1, "max_new_tokens": n, "eos_token_id": []}
    return {**out, "lora_name": lora} if lora else out


def load_all(engine, adapters) -> None:
    for a in adapters.values():
        assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()


PROMPTS = [random_prompt(9, seed=1), random_prompt(37, seed=2), random_prompt(3, seed=3)]


def test_greedy_equals_peft_alone_and_mixed_with_base_requests(lora_setup):
    base, adapters, loaders, _ = lora_setup
    engine = start(loaders["float32"])
    try:
        load_all(engine, adapters)
        assert engine.list_loras("m") == sorted(adapters)
        cases = [(p, a.name, hf_greedy(a.peft, p, 16)) for a in adapters.values() for p in PROMPTS]
        cases += [(p, "", hf_greedy(base, p, 16)) for p in PROMPTS]
        # each adapter changes the output (so the equality below is about the adapter, not the base)
        assert all(want != hf_greedy(base, p, 16) for p, name, want in cases if name)
        for p, name, want in cases:
            assert generate(engine, "m", p, gen(16, name))[0] == want, name
        together = run_together(engine, "m", [(p, gen(16, name)) for p, name, _ in cases])
        assert [tokens for tokens, _ in together] == [want for _, _, want in cases]
    finally:
        engine.shutdown()


def peft_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def test_bf16_greedy_up_to_near_ties(lora_setup):
    base, adapters, loaders, _ = lora_setup
    engine = start(loaders["bfloat16"])
    try:
        load_all(engine, adapters)
        cases = [(p, a) for a in adapters.values() for p in PROMPTS[:2]]
        got = run_together(engine, "m", [(p, gen(12, a.name)) for p, a in cases])
    finally:
        engine.shutdown()
    for (p, a), (tokens, _) in zip(cases, got):
        ref = peft_logits(a.peft, p + tokens)[len(p) - 1:-1]
        best, chosen = ref.max(-1).values, ref[torch.arange(len(tokens)), tokens]
        assert ((best - chosen) <= BF16_NEAR_TIE).all(), (a.name, (best - chosen).tolist())
        top2 = ref.topk(2, -1).values
        tie_free = int(((top2[:, 0] - top2[:, 1]) > BF16_NEAR_TIE).to(torch.int).cumprod(0).sum())
        assert tokens[:tie_free] == ref.argmax(-1).tolist()[:tie_free]


def test_prefix_cache_keys_hold_the_adapter(lora_setup):
    """The same long prompt under the base model, then an adapter, then the same adapter reloaded under the same name
    from another folder: each answer is its own model's (a reused span of another would change it)."""
    base, adapters, loaders, _ = lora_setup
    engine = start(loaders["float32"])
    prompt = random_prompt(50, seed=7)   # three full spans of 16
    try:
        assert generate(engine, "m", prompt, gen(8))[0] == hf_greedy(base, prompt, 8)
        assert engine.load_lora("m", "x", adapters["ad8"].folder) == AsStatus.ALLSPARK_SUCCESS
        assert generate(engine, "m", prompt, gen(8, "x"))[0] == hf_greedy(adapters["ad8"].peft, prompt, 8)
        assert engine.unload_lora("m", "x") == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", "x", adapters["ad16"].folder) == AsStatus.ALLSPARK_SUCCESS
        assert generate(engine, "m", prompt, gen(8, "x"))[0] == hf_greedy(adapters["ad16"].peft, prompt, 8)
        assert generate(engine, "m", prompt, gen(8))[0] == hf_greedy(base, prompt, 8)
        # a hit where one is right: the same adapter and prompt again
        before = engine.get_as_engine_stat("m").prefix_cache_hit_token
        assert generate(engine, "m", prompt, gen(8, "x"))[0] == hf_greedy(adapters["ad16"].peft, prompt, 8)
        assert engine.get_as_engine_stat("m").prefix_cache_hit_token >= before + 48
    finally:
        engine.shutdown()


def test_status_codes_where_dashinfer_returns_them(lora_setup, tmp_path):
    base, adapters, loaders, root = lora_setup
    engine = start(loaders["float32"], max_num=2, max_rank=16)
    a8, a16, a64 = adapters["ad8"], adapters["ad16"], adapters["ad64"]
    serve_check = (PROMPTS[0], hf_greedy(a8.peft, PROMPTS[0], 6))
    try:
        assert engine.load_lora("m", "a8", a8.folder) == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", "a8", a8.folder) == AsStatus.ALLSPARK_LORA_ALREADY_LOADED
        assert engine.load_lora("m", "big", a64.folder) == AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR
        assert "rank 64" in engine.get_last_error() and "lora_max_rank 16" in engine.get_last_error()
        assert engine.load_lora("m", "nowhere", str(tmp_path / "nothing")) == AsStatus.ALLSPARK_LORA_NOT_FOUND
        # DashInfer's rule without a path: <model folder>/<name>.aslora
        assert engine.load_lora("m", "absent") == AsStatus.ALLSPARK_LORA_NOT_FOUND
        assert "absent.aslora" in engine.get_last_error()
        # a bad folder: an adapter of a wider model
        other = make_adapter(str(root / "other_base"), str(tmp_path / "other"), "other", 8, seed=5, hidden_size=96)
        assert engine.load_lora("m", "other", other.folder) == AsStatus.ALLSPARK_PARAM_ERROR
        assert "shape" in engine.get_last_error() and "96" in engine.get_last_error(), engine.get_last_error()
        assert engine.load_lora("m", "a16", a16.folder) == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", "third", a16.folder) == AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR
        status, _, _ = engine.start_request("m", {"input_ids": PROMPTS[0]}, gen(4, "unknown"))
        assert status == AsStatus.ALLSPARK_LORA_NOT_FOUND and "unknown" in engine.get_last_error()
        assert engine.unload_lora("m", "unknown") == AsStatus.ALLSPARK_LORA_NOT_FOUND
        # in use while a request of it lives; unloadable once it is stopped
        status, handle, queue = engine.start_request("m", {"input_ids": PROMPTS[1]}, gen(LONG_RUN_TOKENS, "a16"))
        assert status == AsStatus.ALLSPARK_SUCCESS
        queue.Get()
        assert engine.unload_lora("m", "a16") == AsStatus.ALLSPARK_LORA_IN_USE
        assert engine.get_as_engine_stat("m")                 # the request still runs
        assert engine.stop_request("m", handle) == AsStatus.ALLSPARK_SUCCESS
        engine.release_request("m", handle)
        assert engine.unload_lora("m", "a16") == AsStatus.ALLSPARK_SUCCESS
        assert engine.list_loras("m") == ["a8"]
        # the engine served on after every refusal
        assert generate(engine, "m", serve_check[0], gen(6, "a8"))[0] == serve_check[1]
    finally:
        engine.shutdown()


def test_loading_while_other_requests_run(lora_setup):
    """A base request decodes while an adapter is loaded and a request of it runs beside it; both answers are right."""
    base, adapters, loaders, _ = lora_setup
    engine = start(loaders["float32"])
    try:
        long_prompt = PROMPTS[1]
        status, handle, queue = engine.start_request("m", {"input_ids": long_prompt}, gen(120))
        assert status == AsStatus.ALLSPARK_SUCCESS
        queue.Get()
        a = adapters["ad16"]
        assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS
        assert generate(engine, "m", PROMPTS[0], gen(10, a.name))[0] == hf_greedy(a.peft, PROMPTS[0], 10)
        tokens, _, final = collect(queue)
        assert final == GenerateRequestStatus.GenerateFinished
        engine.release_request("m", handle)
    finally:
        engine.shutdown()
    full = hf_greedy(base, long_prompt, 120)
    assert full[-len(tokens):] == tokens


def test_a_model_without_lora_slots_refuses_adapters(lora_setup):
    _, adapters, loaders, _ = lora_setup
    engine = start(loaders["float32"], max_num=0)
    try:
        status = engine.load_lora("m", "a", adapters["ad8"].folder)
        assert status == AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR
        assert "lora_max_num is 0" in engine.get_last_error()
    finally:
        engine.shutdown()


def test_aslora_next_to_the_model_file_loads_by_name(lora_setup):
    """DashInfer's flow: serialize(..., lora_cfg=...) writes <name>.aslora beside the model; load_lora(model, name)."""
    _, adapters, loaders, root = lora_setup
    loader = loaders["float32"]
    a = adapters["ad8"]
    out = str(root / "float32")
    loader.serialize(None, model_output_dir=out, lora_cfg={"input_base_dir": os.path.dirname(a.folder),
                                                            "lora_names": [a.name], "lora_only": True})
    assert os.path.exists(os.path.join(out, f"{a.name}.aslora"))
    engine = start(loader)
    try:
        assert engine.load_lora("m", a.name) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        assert generate(engine, "m", PROMPTS[0], gen(8, a.name))[0] == hf_greedy(a.peft, PROMPTS[0], 8)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fmt,group", [("uint4", 32), ("int8", -1)])
def test_quantized_base_weights_with_float_adapters(lora_setup, tmp_path, fmt, group):
    """InstantQuant base weights + fp adapters: transformers on the stored codes dequantized independently
    (test_quant_models.py), with PEFT's adapter on top."""
    from peft import PeftModel
    from test_quant_models import hf_with_stored_weights, serialize_quantized

    base, adapters, _, root = lora_setup
    loader = serialize_quantized(str(root / "base"), "m", str(tmp_path), {"weight_format": fmt, "group_size": group})
    a = adapters["ad16"]
    reference = PeftModel.from_pretrained(hf_with_stored_weights(base, loader, fmt, group), a.folder).eval()
    engine = start(loader)
    try:
        assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        cases = [(p, a.name, hf_greedy(reference, p, 12)) for p in PROMPTS]
        got = run_together(engine, "m", [(p, gen(12, name)) for p, name, _ in cases])
        assert [tokens for tokens, _ in got] == [want for _, _, want in cases]
    finally:
        engine.shutdown()


def test_a_mixture_of_experts_model_takes_attention_adapters(tmp_path):
    """Mixtral: an adapter of the attention projections (its experts take none) equals transformers + PEFT."""
    base_dir = str(tmp_path / "moe")
    a = make_adapter(base_dir, str(tmp_path / "ad"), "attn", 8, seed=9,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj"], variant="mixtral")
    base = make_base(base_dir, "mixtral")
    engine = start(serialize(base_dir, "m", str(tmp_path / "as")))
    try:
        assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        cases = [(p, a.name, hf_greedy(a.peft, p, 12)) for p in PROMPTS[:2]]
        cases.append((PROMPTS[0], "", hf_greedy(base, PROMPTS[0], 12)))
        assert cases[0][2] != cases[2][2]
        got = run_together(engine, "m", [(p, gen(12, name)) for p, name, _ in cases])
        assert [tokens for tokens, _ in got] == [want for _, _, want in cases]
    finally:
        engine.shutdown()
