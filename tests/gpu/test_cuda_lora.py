"""LoRA adapters on a GPU rank (marker-free: skipped without CUDA): greedy output against transformers + PEFT for
adapters of ranks 8, 16 and 64, alone and mixed in one batch with base-model requests, fp32 (equal) and bf16 (the
families' near-tie rule), with the decode steps replayed from the graphs captured with adapters and eagerly; an
adapter loaded after the graphs' capture, and one unloaded, are seen by the next replay."""
from __future__ import annotations

import pytest
import torch
from helpers import generate, hf_greedy, random_prompt, run_together, serialize
from lora_cases import make_adapter, make_base

from allspark_client import settings
from allspark_client.types import AsStatus, TargetDevice
from allspark_server import Engine

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
RANKS = {"ad8": 8, "ad16": 16, "ad64": 64}
PROMPTS = [random_prompt(9, seed=1), random_prompt(37, seed=2), random_prompt(3, seed=3)]
BF16_NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_lora")
    base_dir = str(root / "base")
    base = make_base(base_dir)
    adapters = {n: make_adapter(base_dir, str(root / n), n, r, seed=20 + i) for i, (n, r) in enumerate(RANKS.items())}
    return base, adapters, {d: serialize(base_dir, "m", str(root / d), d) for d in ("float32", "bfloat16")}


def cuda_engine(loader) -> Engine:
    engine = Engine()
    b = (loader.create_reference_runtime_config_builder("m", TargetDevice.CUDA, [0], max_batch=16)
         .max_length(512).kv_cache_span_size(16).lora_max_num(3).lora_max_rank(64))
    engine.install_model(b.build())
    engine.start_model("m")
    return engine


def gen(n: int, lora: str = "") -> dict:
    return {"top_k": 1, "max_new_tokens": n, "eos_token_id": [], **({"lora_name": lora} if lora else {})}


@needs_gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_equals_peft_alone_and_mixed(made, monkeypatch, graphs):
    monkeypatch.setenv(settings.CUDA_GRAPHS.name, "1" if graphs else "0")
    base, adapters, loaders = made
    engine = cuda_engine(loaders["float32"])
    try:
        # a base request before any adapter: the plain graphs
        assert generate(engine, "m", PROMPTS[0], gen(12))[0] == hf_greedy(base, PROMPTS[0], 12)
        first = adapters["ad8"]
        assert engine.load_lora("m", first.name, first.folder) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        assert generate(engine, "m", PROMPTS[0], gen(12, first.name))[0] == hf_greedy(first.peft, PROMPTS[0], 12)
        for a in list(adapters.values())[1:]:      # loaded after the adapters' graphs were captured
            assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS, engine.get_last_error()
        cases = [(p, a.name, hf_greedy(a.peft, p, 16)) for a in adapters.values() for p in PROMPTS]
        cases += [(p, "", hf_greedy(base, p, 16)) for p in PROMPTS]
        for p, name, want in cases:
            assert generate(engine, "m", p, gen(16, name))[0] == want, name
        together = run_together(engine, "m", [(p, gen(16, name)) for p, name, _ in cases])
        assert [t for t, _ in together] == [want for _, _, want in cases]
        # unloaded: its slot holds another adapter next, which the replays must see
        assert engine.unload_lora("m", "ad8") == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", "again", adapters["ad64"].folder) == AsStatus.ALLSPARK_SUCCESS
        assert generate(engine, "m", PROMPTS[1], gen(12, "again"))[0] == hf_greedy(adapters["ad64"].peft,
                                                                                   PROMPTS[1], 12)
    finally:
        engine.shutdown()


@needs_gpu
def test_bf16_greedy_up_to_near_ties(made):
    # single requests too: a batch-1 step's GEMV carries the adapter's shrink in its launch (cuda_ops.lora_linear)
    _, adapters, loaders = made
    engine = cuda_engine(loaders["bfloat16"])
    try:
        for a in adapters.values():
            assert engine.load_lora("m", a.name, a.folder) == AsStatus.ALLSPARK_SUCCESS
        cases = [(p, a) for a in adapters.values() for p in PROMPTS[:2]]
        got = run_together(engine, "m", [(p, gen(12, a.name)) for p, a in cases])
        alone = [(p, a) for a in adapters.values() for p in PROMPTS[1:2]]
        got += [(generate(engine, "m", p, gen(12, a.name))[0], None) for p, a in alone]
        cases += alone
    finally:
        engine.shutdown()
    for (p, a), (tokens, _) in zip(cases, got):
        with torch.no_grad():
            ref = a.peft(torch.tensor([p + tokens])).logits[0].double()[len(p) - 1:-1]
        best, chosen = ref.max(-1).values, ref[torch.arange(len(tokens)), tokens]
        assert ((best - chosen) <= BF16_NEAR_TIE).all(), (a.name, (best - chosen).tolist())
        top2 = ref.topk(2, -1).values
        tie_free = int(((top2[:, 0] - top2[:, 1]) > BF16_NEAR_TIE).to(torch.int).cumprod(0).sum())
        assert tokens[:tie_free] == ref.argmax(-1).tolist()[:tie_free]
