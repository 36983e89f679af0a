"""The bytes a decode step reads (the MBU's numerator) against an independent count from the transformers model,
tied and untied; the engine stat reports the bandwidth and a utilisation once decode steps ran."""
from __future__ import annotations

import pytest
from helpers import greedy, random_prompt, serialize, start_engine

from allspark_server.runner.memory_bandwidth import decode_weight_bytes


def hf_decode_bytes(hf_model) -> int:
    """transformers' parameters, each once; the embedding one row, plus the whole table again if the LM head is
    tied to it (the head reads it all)."""
    total = 0
    for name, p in hf_model.named_parameters():
        total += p.element_size() * (p.shape[-1] if "embed_tokens" in name else p.numel())
    if hf_model.config.tie_word_embeddings:
        emb = hf_model.model.embed_tokens.weight
        total += emb.numel() * emb.element_size()
    return total


@pytest.mark.parametrize("variant", ["llama_mha_tied", "llama_gqa_llama3"])
def test_decode_weight_bytes_equal_an_independent_count(tiny_models, tmp_path, variant):
    tm = tiny_models[variant]
    engine = start_engine(serialize(tm.hf_dir, "bw", str(tmp_path)), "bw")
    runner = engine._models["bw"].runner
    model = runner.model
    assert decode_weight_bytes(model, model.model.embed_tokens.weight) == hf_decode_bytes(tm.model)
    (rank,) = runner.rank_decode_bytes                                   # one rank: the whole model
    assert rank.weights == hf_decode_bytes(tm.model)
    a = runner.args
    assert rank.kv_per_token == 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4   # fp32 K and V
    greedy(engine, "bw", random_prompt(10, seed=1), 20)
    stat = engine.get_as_engine_stat("bw")
    assert stat.memory_bandwidth_gbs > 0 and stat.memory_bandwidth_utilization > 0
    assert stat.rank_memory_bandwidth_gbs == [stat.memory_bandwidth_gbs]
    assert stat.rank_memory_bandwidth_utilization == pytest.approx([stat.memory_bandwidth_utilization])
    engine.release_model("bw")
