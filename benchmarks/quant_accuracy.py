"""InstantQuant accuracy: what quantizing the GEMM weights does to a model's predictions.

    python benchmarks/quant_accuracy.py [--quick] [--positions 2048] [--json benchmarks/quant_accuracy.json]

For each weight format and group size, on the benchmark model (random N(0, 0.02) weights) and on the same model
with trained-like weight statistics (heavy-tailed entries, per-channel scales spread over a decade, a few outlier
input features), teacher-forced over `--positions` tokens: relative logit error ||l_q - l|| / ||l||, top-1
agreement and the mean KL(p || p_q), against the unquantized fp32 model (transformers, weights replaced by the
stored codes dequantized); the row "bf16 g0" rounds the same weights to bf16 instead, for scale (random models
have nearly flat, near-tied output distributions, so top-1 agreement is low even there). Then the Engine's greedy output with int8 per-channel weights vs the unquantized bf16
model's: the fraction of prompts whose first 32 tokens agree.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import FULL, QUICK, build_model  # noqa: E402

VARIANTS = [("bf16", 0), ("int8", -1), ("int8", 128), ("uint8", -1), ("int4", 32), ("int4", 128), ("uint4", 32), ("uint4", 64),
            ("uint4", 128)]
GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def trained_like(model, seed: int = 0):
    """Weights with the statistics of trained ones: Student-t(4) entries, output-channel scales log-normal
    (sigma 0.6), and 1% of each GEMM's input features 8x larger (the outlier features of real LLMs)."""
    g = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.rsplit(".", 1)[-1] in GEMMS:
                n, k = mod.weight.shape
                t = torch.distributions.StudentT(4.0).sample((n, k)) * 0.02 / 1.41
                t *= torch.exp(torch.randn(n, 1, generator=g) * 0.6)
                t[:, torch.randperm(k, generator=g)[:max(1, k // 100)]] *= 8
                mod.weight.copy_(t)
    return m


def quantized_copy(model, fmt: str, group: int):
    from allspark_server.quant.formats import dequantize, quantize
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.rsplit(".", 1)[-1] in GEMMS and fmt == "bf16":       # the baseline: bf16 rounding alone
                mod.weight.copy_(mod.weight.to(torch.bfloat16).float())
            elif name.rsplit(".", 1)[-1] in GEMMS:
                q = quantize(mod.weight, fmt, group)
                mod.weight.copy_(dequantize(q["qweight"], q["scales"], q.get("zeros"), fmt, group))
    return m


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(chunk[None]).logits[0].float() for chunk in ids])


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    return {"rel_logit_error": ((got - ref).norm() / ref.norm()).item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "kl": (lp.exp() * (lp - lq)).sum(-1).mean().item()}


def greedy_agreement(hf_dir: str, prompts: list[list[int]], tokens: int = 32) -> float:
    from allspark_server import Engine, HuggingFaceModel
    engine = Engine()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, quant in (("dense", None), ("int8", {"weight_format": "int8"})):
            m = HuggingFaceModel(hf_dir, name, user_set_data_type="bfloat16").load_model()
            m.serialize(None, model_output_dir=d, enable_quant=quant is not None, customized_quant_config=quant)
            cfg = m.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4).max_length(256).build()
            engine.install_model(cfg)
            engine.start_model(name)
            out[name] = []
            for p in prompts:
                _, handle, queue = engine.start_request(name, {"input_ids": p},
                                                        {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []})
                got = []
                while (el := queue.Get()) is not None:
                    got.extend(el.ids_from_generate)
                engine.release_request(name, handle)
                out[name].append(got)
    engine.shutdown()
    return sum(a == b for a, b in zip(out["dense"], out["int8"])) / len(prompts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--json", default="benchmarks/quant_accuracy.json")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM
    spec = QUICK if a.quick else FULL
    hf_dir = build_model(spec, "float32")
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab"], (a.positions,), generator=g).view(-1, 512)
    report = {"model_params_m": sum(t.numel() for t in base.parameters()) / 1e6, "positions": a.positions,
              "stats": {}}
    for stats, model in (("random N(0, 0.02)", base), ("trained-like", trained_like(base))):
        ref = logits(model, ids)
        rows = {}
        for fmt, group in VARIANTS:
            rows[f"{fmt} g{group}"] = compare(ref, logits(quantized_copy(model, fmt, group), ids))
            print(f"{stats:>18}  {fmt:>5} g{group:<4}  " + "  ".join(f"{k} {v:.4g}" for k, v in rows[f"{fmt} g{group}"].items()),
                  flush=True)
        report["stats"][stats] = rows
    prompts = [torch.randint(0, spec["vocab"], (16 + 8 * i,), generator=g).tolist() for i in range(16)]
    report["greedy32_int8_vs_bf16"] = greedy_agreement(build_model(spec, "bfloat16"), prompts)
    print(f"Engine greedy, first 32 tokens equal (int8 per channel vs bf16), {len(prompts)} prompts: "
          f"{report['greedy32_int8_vs_bf16']:.2f}")
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
