"""The other model families against transformers: Qwen3, GLM-4 and Llama's rope scalings (transformers' own
classes), and the remote-code
layouts ChatGLM2/3/GLM-4-chat, Qwen (v1) and Baichuan2-7B, written from an equivalent native model (GLM, Qwen2,
Llama; tests/remote_layouts.py) and checked against that model's logits: fp32 teacher-forced logits on every
compute path, greedy tokens through the Engine, and 2-rank tensor-parallel logits equal to one process."""
from __future__ import annotations

import pytest
import torch

from allspark_server.tiny_model import build_tiny_model
from helpers import greedy, hf_greedy, random_prompt, serialize, start_engine
from remote_layouts import write_baichuan, write_chatglm, write_qwen1
from test_hf_parity import hf_logits, kernels, runner_for, teacher_forced_logits  # noqa: F401 (a fixture)
from test_tensor_parallel import tp_logits

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
}


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
def test_fp32_logits_match_the_reference(families, tmp_path, family, kernels):
    folder, model = families[family]
    prompt = random_prompt(PROMPT_LEN, seed=5)
    tokens = prompt + hf_greedy(model, prompt, DECODE_STEPS)
    loader = serialize(folder, family, str(tmp_path))
    assert loader.args.architecture == (model.config.architectures[0] if FAMILIES[family][1] is None
                                        else loader.hf_config["architectures"][0])
    ours = teacher_forced_logits(runner_for(loader, family, device=kernels), tokens, PROMPT_LEN)
    ref = hf_logits(model, tokens)
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_through_the_engine_and_a_2_rank_pool(families, tmp_path, family):
    folder, model = families[family]
    loader = serialize(folder, family, str(tmp_path))
    engine = start_engine(loader, family)
    prompts = [random_prompt(20 + 7 * i, seed=30 + i) for i in range(3)]
    want = [hf_greedy(model, p, 16) for p in prompts]
    assert [greedy(engine, family, p, 16) for p in prompts] == want
    engine.release_model(family)
    result = tp_logits(loader, prompts[0] + want[0], len(prompts[0]), tmp_path)
    assert result["world_size"] == 2 and result["argmax_equal"]
    assert result["max_abs_diff"] <= 1e-4


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
