"""Batch-invariant mode (ALLSPARK_BATCH_INVARIANT, ops.set_batch_invariant): 64 concurrent greedy requests (8 prompts x
8 copies, chunked prefill, prefix-cache hits among the copies) give each request exactly the tokens it gets alone,
in bf16 and with quantized weights, through the Engine and a 2-rank pool. Without the mode these differ in bf16 (the
GEMV's rows against the GEMM's above its row limit, batch-1 kernels summing in another order, prompt chunks through
another attention kernel); the kernels' own row invariance is checked in tests/kernels/test_row_invariance.py."""
from __future__ import annotations

import pytest
from helpers import greedy, random_prompt, run_together, serialize, start_engine
from test_quant_models import serialize_quantized

from allspark_client import settings
from allspark_server.compute import ops

pytestmark = pytest.mark.skipif(ops.native() is None, reason="batch-invariant mode needs the native kernels")

PROMPT_LENS = [3, 9, 17, 30, 41, 52, 66, 80]
COPIES = 8
NEW_TOKENS = 12
PREFILL_CHUNK = 32      # longer prompts are prefilled in chunks, split differently when the step is shared
QUANT = {"weight_format": "uint4_min", "group_size": 32}


def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=500 + i) for i, n in enumerate(PROMPT_LENS)]


def batched_vs_alone(engine, name: str) -> list[str]:
    """Each prompt alone, then all COPIES of every prompt started at once: the requests whose tokens differ."""
    ids = prompts()
    alone = [greedy(engine, name, p, NEW_TOKENS) for p in ids]
    gen = {"top_k": 1, "max_new_tokens": NEW_TOKENS, "eos_token_id": []}
    together = run_together(engine, name, [(p, gen) for p in ids for _ in range(COPIES)])
    return [f"prompt {i // COPIES} copy {i % COPIES}: {tokens} alone {alone[i // COPIES]}"
            for i, (tokens, _) in enumerate(together) if tokens != alone[i // COPIES]]


@pytest.fixture
def invariant():
    before = ops.batch_invariant()
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(before)


@pytest.fixture(scope="module")
def loaders(llama, tmp_path_factory):
    """The GQA Llama in bf16, dense and quantized (uint4_min, llama.cpp's Q4_1)."""
    dense = serialize(llama.hf_dir, "dense", str(tmp_path_factory.mktemp("bi_dense")), dtype="bfloat16")
    quant = serialize_quantized(llama.hf_dir, "quant", str(tmp_path_factory.mktemp("bi_quant")), QUANT,
                                dtype="bfloat16")
    return {"dense": dense, "quant": quant}


@pytest.mark.parametrize("name", ["dense", "quant"])
def test_engine_batched_equals_alone(invariant, loaders, name):
    engine = start_engine(loaders[name], name, max_batch=64, max_length=256, prefill=PREFILL_CHUNK)
    try:
        differ = batched_vs_alone(engine, name)
    finally:
        engine.sync_request(name)
        engine.release_model(name)
    assert not differ, (f"{len(differ)}/{len(PROMPT_LENS) * COPIES} differ from their solo run:\n"
                        + "\n".join(differ[:4]))


def test_pool_batched_equals_alone(loaders):
    """The ranks read the mode from the environment the launcher passes on."""
    from allspark_client import ClientEngine
    with settings.override(ALLSPARK_BATCH_INVARIANT="1"):
        client = ClientEngine(ranks=2)
    try:
        for name in ("dense", "quant"):
            cfg = (loaders[name].create_reference_runtime_config_builder(name, "cpu", [0], max_batch=64)
                   .max_length(256).kv_cache_span_size(16).max_prefill_length(PREFILL_CHUNK).build())
            assert client.install_model(cfg) == 0 and client.start_model(name) == 0, client.get_last_error()
            assert '"world_size": 2' in client.get_model_info(name)
            differ = batched_vs_alone(client, name)
            assert not differ, f"{name}: {len(differ)} differ from their solo run:\n" + "\n".join(differ[:4])
            assert client.stop_model(name) == 0 and client.release_model(name) == 0
    finally:
        client.close()
