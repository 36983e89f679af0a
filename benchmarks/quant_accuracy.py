"""InstantQuant accuracy: what quantizing the GEMM weights does to a model's predictions.

    python benchmarks/quant_accuracy.py [--quick] [--positions 2048] [--json PATH]

For each weight format and group size, on the benchmark model (random N(0, 0.02) weights) and on the same model
with trained-like weight statistics (heavy-tailed entries, per-channel scales spread over a decade, a few outlier
input features), teacher-forced over `--positions` tokens: relative logit error ||l_q - l|| / ||l||, top-1
agreement and the mean KL(p || p_q), against the unquantized fp32 model (transformers, weights replaced by the
stored codes dequantized); the row "bf16 g0" rounds the same weights to bf16 instead, for scale (random models
have nearly flat, near-tied output distributions, so top-1 agreement is low even there). The rows "kv int8" /
"kv uint4" keep the weights and quantize the K (after rotary) and V rows as the quantized KV spans store them;
the rows "kv fp8" the same with fp8 spans (GPU ranks only: no Engine row); fp8_e4m3 weights too (teacher-forced
only); the rows "... a8" are compute_method activate_quant: the same codes, each GEMM input rounded to int8 per token.
Then the Engine's greedy output (bf16 model; int8 / uint4 KV, int8 per-channel weights, both, int8 activate_quant) vs
the unquantized bf16 model's: the fraction of prompts whose first 32 tokens agree, over all prompts and over the
"tie-free" ones (every top-1 logit along the fp32 greedy path leads by more than twice the largest logit change
that bf16 rounding causes, and bf16 gives those tokens).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from common import build_model

VARIANTS = [("bf16", 0), ("int8", -1), ("int8", 128), ("uint8", -1), ("int4", 32), ("int4", 128), ("uint4", 32),
            ("uint4", 64), ("uint4", 128), ("fp8_e4m3", -1), ("fp8_e4m3", 128)]
A8_VARIANTS = [("int8", -1), ("int8", 128), ("int4", 32), ("uint4", 64)]   # compute_method activate_quant
GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def trained_like(model, seed: int = 0):
    """Weights with the statistics of trained ones: Student-t(4) entries, output-channel scales log-normal
    (sigma 0.6), and 1% of each GEMM's input features 8x larger (the outlier features of real LLMs)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)   # StudentT samples from the global generator: the same weights on every run
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


def with_int8_inputs(model):
    """activate_quant's activations: every GEMM's input rounded to int8 per token, as the kernels round it."""
    from allspark_server.compute.reference import round_activations_reference
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in GEMMS:
            mod.register_forward_pre_hook(lambda _, args: (round_activations_reference(args[0], 8).to(args[0].dtype),))
    return model


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(chunk[None]).logits[0].float() for chunk in ids])


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    return {"rel_logit_error": ((got - ref).norm() / ref.norm()).item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "kl": (lp.exp() * (lp - lq)).sum(-1).mean().item()}


def engine_greedy(hf_dir: str, prompts: list[list[int]], variants: dict, tokens: int = 32) -> dict:
    """The Engine's greedy tokens for each prompt, per variant {name: (weight quant config or None, kv mode)}."""
    from allspark_server import Engine, HuggingFaceModel
    engine = Engine()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (quant, kv_mode) in variants.items():
            m = HuggingFaceModel(hf_dir, name, user_set_data_type="bfloat16").load_model()
            m.serialize(None, model_output_dir=d, enable_quant=quant is not None, customized_quant_config=quant)
            cfg = (m.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4).max_length(256)
                   .kv_cache_mode(kv_mode).build())
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
            engine.stop_model(name)
            engine.release_model(name)
    engine.shutdown()
    return out


@torch.inference_mode()
def hf_greedy_margin(model, prompt: list[int], tokens: int = 32) -> tuple[list[int], float]:
    """transformers' greedy tokens and the smallest top-1 minus top-2 logit gap along them."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([s[0].float().topk(2).values for s in out.scores])
    return out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


class FakeQuantKV:
    """transformers' Llama attention with its K (after rotary) and V rows quantized per token and head as
    allspark's int8 / uint4 / fp8 KV spans store them (quant/kv.py), for teacher-forced accuracy."""

    def __init__(self, model, mode: str):
        import transformers.models.llama.modeling_llama as llama

        from allspark_server.quant import kv
        self.llama, self.model, self.mode, self.kv = llama, model, mode, kv
        self.rotary = llama.apply_rotary_pos_emb

    def _fq(self, x):   # x [..., D]
        return self.kv.dequantize_rows(*self.kv.quantize_rows(x, self.mode), self.mode).to(x.dtype)

    def __enter__(self):
        def rotary(q, k, cos, sin, *a, **kw):
            q, k = self.rotary(q, k, cos, sin, *a, **kw)
            return q, self._fq(k)
        self.llama.apply_rotary_pos_emb = rotary
        self.hooks = []
        for name, mod in self.model.named_modules():
            if name.endswith("v_proj"):
                d = self.model.config.head_dim
                self.hooks.append(mod.register_forward_hook(
                    lambda m, i, o, d=d: self._fq(o.view(*o.shape[:-1], -1, d)).view(o.shape)))
        return self.model

    def __exit__(self, *exc):
        self.llama.apply_rotary_pos_emb = self.rotary
        for h in self.hooks:
            h.remove()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    common.add_smoke_flag(p)
    p.add_argument("--positions", type=int, default=2048, help="a multiple of 512, or fewer")
    p.add_argument("--json", default=None, help="default: benchmarks/results/quant-accuracy-<machine>.json "
                   "(--quick: quant-accuracy-quick-<machine>.json; --smoke: under results/quick/)")
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("quant-accuracy-quick" if a.quick else "quant-accuracy", quick=a.smoke)
    from transformers import AutoModelForCausalLM
    spec = common.spec_of(a)
    hf_dir = build_model(spec, "float32")
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab"], (a.positions,), generator=g).view(-1, min(512, a.positions))
    report = {"model_params_m": sum(t.numel() for t in base.parameters()) / 1e6, "positions": a.positions,
              "stats": {}}
    for stats, model in (("random N(0, 0.02)", base), ("trained-like", trained_like(base))):
        ref = logits(model, ids)
        rows = {}
        for fmt, group in VARIANTS:
            rows[f"{fmt} g{group}"] = compare(ref, logits(quantized_copy(model, fmt, group), ids))
            print(f"{stats:>18}  {fmt:>5} g{group:<4}  "
                  + "  ".join(f"{k} {v:.4g}" for k, v in rows[f"{fmt} g{group}"].items()), flush=True)
        for fmt, group in A8_VARIANTS:
            key = f"{fmt} g{group} a8"
            rows[key] = compare(ref, logits(with_int8_inputs(quantized_copy(model, fmt, group)), ids))
            print(f"{stats:>18}  {key:<11}  " + "  ".join(f"{k} {v:.4g}" for k, v in rows[key].items()), flush=True)
        report["stats"][stats] = rows
    for stats, model in (("random N(0, 0.02)", base), ("trained-like", trained_like(base))):
        ref = logits(model, ids)
        for mode in ("int8", "uint4", "fp8"):
            with FakeQuantKV(model, mode) as fq:
                row = compare(ref, logits(fq, ids))
            report["stats"][stats][f"kv {mode}"] = row
            print(f"{stats:>18}  kv {mode:<6}  " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    n_prompts, tokens = (2, 8) if a.smoke else (16, 32)      # greedy32: the first 32 tokens (--smoke: 8)
    prompts = [torch.randint(0, spec["vocab"], (16 + 8 * i,), generator=g).tolist() for i in range(n_prompts)]
    bf16_dir = build_model(spec, "bfloat16")
    out = engine_greedy(bf16_dir, prompts, {"bf16": (None, "default"), "bf16_kv_int8": (None, "int8"),
                                            "bf16_kv_uint4": (None, "uint4"),
                                            "int8": ({"weight_format": "int8"}, "default"),
                                            "int8_kv_int8": ({"weight_format": "int8"}, "int8"),
                                            "int8_a8": ({"weight_format": "int8", "compute_method": "activate_quant"},
                                                        "default")}, tokens)
    # "tie-free" prompts: along the fp32 model's greedy path every top-1 logit leads the runner-up by more than
    # twice the largest logit change bf16 rounding of the weights caused in the teacher-forced run above, and
    # bf16 itself gives those 32 tokens
    bf16_error = (logits(quantized_copy(base, "bf16", 0), ids) - logits(base, ids)).abs().max().item()
    fp32 = [hf_greedy_margin(base, p, tokens) for p in prompts]
    tie_free = [i for i, (toks, margin) in enumerate(fp32) if margin > 2 * bf16_error and out["bf16"][i] == toks]
    report["greedy32_tie_threshold_logits"] = 2 * bf16_error
    agree = lambda name, idx: sum(out[name][i] == out["bf16"][i] for i in idx) / max(1, len(idx))  # noqa: E731
    everything = range(len(prompts))
    report["greedy32"] = {"prompts": len(prompts), "bf16_tie_free_prompts": len(tie_free),
                          **{f"{name}_vs_bf16_all": agree(name, everything) for name in out if name != "bf16"},
                          **{f"{name}_vs_bf16_tie_free": agree(name, tie_free) for name in out if name != "bf16"}}
    report["greedy32_int8_vs_bf16"] = report["greedy32"]["int8_vs_bf16_all"]
    print(f"Engine greedy, first 32 tokens equal to the bf16 model's, {len(prompts)} prompts "
          f"({len(tie_free)} tie-free: every top-1 margin > {2 * bf16_error:.3g} logits):")
    for name in out:
        if name != "bf16":
            print(f"  {name:<14} all {agree(name, everything):.2f}   tie-free {agree(name, tie_free):.2f}")
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
