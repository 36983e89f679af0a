"""Speculative decoding on a GPU rank (marker-free: skipped without CUDA): greedy output with ngram speculation
equals greedy output without it, fp32 and bf16, alone and batched, with the verify rows replayed from the decode
graphs (each verify chunk a run of decode rows, runner/cuda_graphs.py) and eagerly; and with a draft model (the
model's own int8 copy, on the same GPU). A speculating model of hidden size from model_runner.INVARIANT_MIN_HIDDEN,
or of 8 proposed tokens and more (INVARIANT_MIN_VERIFY_ROWS), unless its speculative_rows says otherwise, takes the
batch-invariant 16-bit GEMVs (compute/row_mode.py) in all its steps: the engine without speculation it is
then compared with takes them too (batch-invariant mode), and so does the same engine's request with
speculative=False."""
from __future__ import annotations

import pytest
import torch
from helpers import generate, random_prompt, run_together, serialize

from allspark_client import settings
from allspark_client.types import TargetDevice
from allspark_server import Engine
from allspark_server.compute import ops
from allspark_server.runner import model_runner

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GREEDY = {"top_k": 1, "eos_token_id": [], "max_new_tokens": 80}


def cuda_engine(loader, name: str, speculative: bool, draft: dict | None = None, invariant: bool = False,
                tokens: int = 4, rows: str = "auto") -> Engine:
    """invariant: the model installed in batch-invariant mode (what a speculating model's runner takes itself);
    tokens, rows: the ngram speculation's num_speculative_tokens and speculative_rows."""
    engine = Engine()
    b = (loader.create_reference_runtime_config_builder(name, TargetDevice.CUDA, [0], max_batch=4)
         .max_length(512).kv_cache_span_size(16))
    if draft:
        b.speculative_decoding("draft", 3, **draft)
    elif speculative:
        b.speculative_decoding("ngram", tokens, speculative_rows=rows)
    before = ops.batch_invariant()
    ops.set_batch_invariant(invariant)      # read as the model's runner is built
    try:
        engine.install_model(b.build())
    finally:
        ops.set_batch_invariant(before)
    engine.start_model(name)
    return engine


@needs_gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype,tokens,rows,invariant", [
    ("float32", 4, "auto", False), ("bfloat16", 4, "auto", False), ("bfloat16", 4, "invariant", True),
    ("bfloat16", 8, "auto", True), ("bfloat16", 8, "alone", False),
], ids=["float32", "bfloat16", "bfloat16-invariant", "bfloat16-k8", "bfloat16-k8-alone"])
def test_ngram_greedy_on_the_gpu_equals_greedy_without(llama, tmp_path, monkeypatch, dtype, tokens, rows, invariant,
                                                       graphs):
    """invariant: the speculating model takes invariant rows (its speculative_rows, or "auto" from 8 proposed tokens:
    model_runner.INVARIANT_MIN_VERIFY_ROWS; the tiny model is far below INVARIANT_MIN_HIDDEN): the model without
    speculation is installed in batch-invariant mode, whose kernels those are."""
    monkeypatch.setenv(settings.CUDA_GRAPHS.name, "1" if graphs else "0")
    loader = serialize(llama.hf_dir, "m", str(tmp_path), dtype=dtype)
    base = cuda_engine(loader, "m", False, invariant=invariant)
    spec = cuda_engine(loader, "m", True, tokens=tokens, rows=rows)
    assert spec._models["m"].runner.invariant_rows == invariant
    prompts = []
    for seed in range(4):
        p = random_prompt(36, 40 + seed)
        prompts.append(p + p[4:30] + p[:12])
    want = [generate(base, "m", p, GREEDY)[0] for p in prompts]
    assert [generate(spec, "m", p, GREEDY)[0] for p in prompts] == want
    assert [t for t, _ in run_together(spec, "m", [(p, GREEDY) for p in prompts[:3]])] == want[:3]
    assert generate(spec, "m", prompts[0], dict(GREEDY, speculative=False))[0] == want[0]
    stat = spec.get_as_engine_stat("m")
    assert stat.spec_accepted_tokens > 0, stat


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_greedy_on_the_gpu_equals_greedy_without(llama, tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(model_runner, "INVARIANT_MIN_HIDDEN", 0)      # the target takes invariant rows
    loader = serialize(llama.hf_dir, "m", str(tmp_path), dtype=dtype)
    base = cuda_engine(loader, "m", False, invariant=True)
    spec = cuda_engine(loader, "m", True, draft={"draft_model": llama.hf_dir, "draft_quantize": "int8"})
    prompts = [random_prompt(30, 60 + seed) for seed in range(3)]
    want = [generate(base, "m", p, GREEDY)[0] for p in prompts]
    assert [generate(spec, "m", p, GREEDY)[0] for p in prompts] == want
    assert [t for t, _ in run_together(spec, "m", [(p, GREEDY) for p in prompts])] == want
    stat = spec.get_as_engine_stat("m")
    assert stat.spec_verify_steps > 0 and stat.spec_acceptance_rate > 0.5, stat
