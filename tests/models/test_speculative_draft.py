"""Speculative decoding with a draft model (speculative/draft.py): greedy output equals the output without
speculation whatever the draft (the target itself, its InstantQuant int4 copy, an unrelated random model), alone
and three requests batched together; the target as its own draft is nearly always accepted. A draft whose
vocabulary exceeds the target's, or whose architecture is unknown, is refused at install."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import greedy, random_prompt, run_together, serialize, start_engine

from allspark_client.types import AsException
from allspark_server import TargetDevice
from allspark_server.loader.model_file import read_model_graph
from allspark_server.loader.tiny_model import VOCAB_SIZE, build_tiny_model
from allspark_server.speculative.draft import serialize_draft

NEW_TOKENS = 60
PROMPTS = [random_prompt(n, seed) for n, seed in ((5, 1), (23, 2), (70, 3))]
GEN = {"top_k": 1, "max_new_tokens": NEW_TOKENS, "eos_token_id": []}


@pytest.fixture(scope="module")
def target(llama, tmp_path_factory):
    """(engine serving the tiny Llama as 'base', its loader, the base's greedy outputs: alone and together)."""
    loader = serialize(llama.hf_dir, "base", str(tmp_path_factory.mktemp("draft_target")))
    engine = start_engine(loader, "base", max_length=512)
    alone = [greedy(engine, "base", ids, NEW_TOKENS) for ids in PROMPTS]
    together = [t for t, _ in run_together(engine, "base", [(ids, GEN) for ids in PROMPTS])]
    yield engine, loader, alone, together
    engine.shutdown()


def install_with_draft(engine, loader, name: str, draft_model: str, quantize: str = "") -> None:
    cfg = (loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=8)
           .max_length(512).kv_cache_span_size(16)
           .speculative_decoding("draft", 4, draft_model=draft_model, draft_quantize=quantize).build())
    engine.install_model(cfg)


def check_same_output(target, name: str, draft_model: str, quantize: str = "") -> float:
    """Greedy output with the draft equals the base's (alone and together); the acceptance rate."""
    engine, loader, alone, together = target
    install_with_draft(engine, loader, name, draft_model, quantize)
    engine.start_model(name)
    try:
        for ids, want in zip(PROMPTS, alone):
            assert greedy(engine, name, ids, NEW_TOKENS) == want
        got = [t for t, _ in run_together(engine, name, [(ids, GEN) for ids in PROMPTS])]
        assert got == together
        stat = engine.get_as_engine_stat(name)
        assert stat.spec_verify_steps > 0
        return stat.spec_acceptance_rate
    finally:
        engine.release_model(name, force=True)


def test_target_as_its_own_draft(target, llama):
    rate = check_same_output(target, "self_draft", llama.hf_dir)
    assert rate > 0.9, f"acceptance {rate:.3f} of the target's own proposals"


def test_int4_copy_as_draft(target, llama):
    rate = check_same_output(target, "int4_draft", llama.hf_dir, quantize="int4")
    assert rate > 0.5, f"acceptance {rate:.3f} of the int4 copy's proposals"


def test_grouped_int4_copy_as_draft(target, llama, tmp_path):
    """draft_quantize "uint4_g32": the copy in groups of 32 k (its LM head too), as exact as any draft."""
    quant = read_model_graph(*serialize_draft(llama.hf_dir, "", "uint4_g32", str(tmp_path / "a"), VOCAB_SIZE)).quant
    assert (quant.weight_format, quant.group_size, quant.lm_head) == ("uint4", 32, True)
    quant = read_model_graph(*serialize_draft(llama.hf_dir, "", "uint4_g32+fp_head", str(tmp_path / "b"),
                                              VOCAB_SIZE)).quant
    assert (quant.weight_format, quant.group_size, quant.lm_head) == ("uint4", 32, False)
    rate = check_same_output(target, "uint4_g32_draft", llama.hf_dir, quantize="uint4_g32")
    assert rate > 0.5, f"acceptance {rate:.3f} of the grouped uint4 copy's proposals"


def test_unrelated_draft_keeps_output(target, tmp_path):
    other = str(tmp_path / "other")
    build_tiny_model(other, seed=11, hidden_size=32, num_layers=1, intermediate_size=64, tokenizer=False)
    check_same_output(target, "other_draft", other)


def test_refused_drafts(target, tmp_path, llama):
    engine, loader, _, _ = target
    big = str(tmp_path / "big_vocab")
    build_tiny_model(big, hidden_size=32, num_layers=1, intermediate_size=64, tokenizer=False,
                     vocab_size=VOCAB_SIZE + 64)
    with pytest.raises(AsException, match=f"vocabulary of {VOCAB_SIZE + 64} tokens.*target model's {VOCAB_SIZE}"):
        install_with_draft(engine, loader, "big_draft", big)
    with pytest.raises(AsException, match="draft_quantize 'uint4_gx': a group size after '_g'"):
        install_with_draft(engine, loader, "bad_group_draft", llama.hf_dir, quantize="uint4_gx")
    with pytest.raises(AsException, match="draft_quantize 'int4\\+head': the one suffix is '\\+fp_head'"):
        install_with_draft(engine, loader, "bad_suffix_draft", llama.hf_dir, quantize="int4+head")
    unknown = str(tmp_path / "unknown")
    shutil.copytree(llama.hf_dir, unknown)
    with open(os.path.join(unknown, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["NoSuchForCausalLM"]
    with open(os.path.join(unknown, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(AsException, match="NoSuchForCausalLM.*not supported"):
        install_with_draft(engine, loader, "unknown_draft", unknown)


def test_catch_up_row_by_row_proposes_the_same(target, llama, monkeypatch):
    """The catch-up rows one a step (what a runner decoding from CUDA graphs does) give the same proposals, call for
    call, as the verify chunk a CPU runner takes, and the same output."""
    from allspark_server.speculative import draft

    def proposals(row_by_row: bool) -> list:
        seen = []
        real = draft.DraftProposer.propose
        monkeypatch.setattr(draft, "catches_up_row_by_row", lambda runner: row_by_row)
        monkeypatch.setattr(draft.DraftProposer, "propose",
                            lambda self, requests, counts: seen.append(real(self, requests, counts)) or seen[-1])
        check_same_output(target, f"int4_rows_{row_by_row}", llama.hf_dir, quantize="int4")
        monkeypatch.undo()
        return seen

    chunked, stepped = proposals(False), proposals(True)
    assert len(chunked) > 10 and stepped == chunked
