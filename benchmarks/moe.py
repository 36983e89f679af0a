"""Mixture-of-experts decode: batch-1 tokens/s against the roofline of the *active* parameters, and 8 requests at
once against transformers on the same model.

    python benchmarks/moe.py [--quick] [--json PATH]

The model: Qwen3-MoE-shaped, random bf16 weights (hidden 1024, 12 layers, 32 experts of 512, top 4, 8 query / 4 KV
heads of 128; --quick: a smaller one). A decode token reads every non-expert tensor (the embedding one row), the
k experts its router picks in each MoE layer (k/E of that layer's expert bytes: every expert has the same size) and
its KV cache; counted from the serialized model file, not from the engine. Roofline = copy bandwidth / those bytes,
the bandwidth measured around each run (cpu_rounds.decode_rounds: the engines interleave round by round).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.spin_openmp()    # before torch loads: transformers shares the process with the Engine

import workloads as W  # noqa: E402
from cpu_rounds import decode_rounds  # noqa: E402

FULL = dict(hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=4, head_dim=128, num_experts=32, top_k=4,
            moe_intermediate_size=512, vocab=512, new_tokens=96, repeats=5, concurrency=8, prompt=128)
QUICK = dict(FULL, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8, top_k=2,
             moe_intermediate_size=256, new_tokens=32, repeats=2)
SMOKE = dict(FULL, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2,
             moe_intermediate_size=32, new_tokens=8, repeats=1, concurrency=2, prompt=16)
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def build_moe(spec: dict) -> str:
    import torch
    import transformers
    key = "-".join(str(spec[k]) for k in ("hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size"))
    d = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench", f"qwen3moe-{key}-bfloat16")
    if not os.path.exists(os.path.join(d, "config.json")):
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=spec["vocab"], hidden_size=spec["hidden_size"], intermediate_size=4 * spec["hidden_size"],
            num_hidden_layers=spec["num_layers"], num_attention_heads=spec["num_heads"],
            num_key_value_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], num_experts=spec["num_experts"],
            num_experts_per_tok=spec["top_k"], moe_intermediate_size=spec["moe_intermediate_size"],
            norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
            eos_token_id=1, pad_token_id=2)
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
        model.to(torch.bfloat16).save_pretrained(d)
    return d


def active_bytes_per_token(weights_path: str, top_k: int, num_experts: int, ctx_bytes: int) -> dict:
    """From the model file: (all bytes, active bytes) a decode token reads."""
    from safetensors import safe_open
    dense = expert = 0
    with safe_open(weights_path, framework="pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            n = 1
            for d in sl.get_shape():
                n *= d
            nbytes = n * {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()]
            if "embed_tokens" in name:
                nbytes = sl.get_shape()[-1] * 2
            if EXPERT.search(name):
                expert += nbytes
            else:
                dense += nbytes
    return {"all": dense + expert + ctx_bytes, "active": dense + expert * top_k // num_experts + ctx_bytes}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    common.add_smoke_flag(p)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", default=None, help="default: benchmarks/results/moe-<machine>.json (--quick: under "
                   "results/quick/)")
    a = p.parse_args(argv)
    a.json = a.json or common.result_path("moe", quick=a.quick or a.smoke)
    spec = SMOKE if a.smoke else QUICK if a.quick else FULL
    import torch
    from transformers import AutoModelForCausalLM

    from allspark_server import Engine, HuggingFaceModel
    torch.set_num_threads(a.threads)
    hf_dir = build_moe(spec)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    loader = HuggingFaceModel(hf_dir, "bench-moe", user_set_data_type="bfloat16")
    loader.load_model().serialize(None, model_output_dir=tempfile.mkdtemp(prefix="allspark-moe-")).free_model()
    n, vocab = spec["new_tokens"], spec["vocab"]
    kv_token = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * 2
    nbytes = active_bytes_per_token(loader.weights_path, spec["top_k"], spec["num_experts"],
                                    int((W.DECODE_PROMPT_LEN + n / 2) * kv_token))
    engine = Engine()
    cfg = (loader.create_reference_runtime_config_builder("bench-moe", "cpu", [0], max_batch=spec["concurrency"])
           .max_length(spec["prompt"] + n + 16).build())
    engine.install_model(cfg)
    engine.start_model("bench-moe")
    report = {"machine": common.machine_name(), "spec": spec, "threads": a.threads,
              "params_m": sum(t.numel() for t in hf.parameters()) / 1e6, "bytes_per_token": nbytes}
    decoders = {"allspark": lambda r: W.decode_tps(engine, "bench-moe", vocab, n, seed=r),
                "transformers": lambda r: W.hf_decode_tps(hf, vocab, n, seed=r)}
    report["decode_b1"] = decode_rounds(decoders, nbytes["active"], spec["repeats"])
    print(json.dumps({k: v for k, v in report["decode_b1"].items() if k != "decode_b1_tps_by_round"}, indent=1),
          flush=True)
    c = spec["concurrency"]
    ours = W.concurrent_tps(engine, "bench-moe", vocab, c, spec["prompt"], n)
    theirs = W.hf_concurrent_tps(hf, vocab, c, spec["prompt"], n)
    report[f"concurrent_{c}"] = {"allspark_tps": ours, "transformers_tps": theirs, "ratio": ours / theirs}
    print(json.dumps(report[f"concurrent_{c}"]), flush=True)
    engine.stop_model("bench-moe")
    engine.release_model("bench-moe")
    engine.shutdown()
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
