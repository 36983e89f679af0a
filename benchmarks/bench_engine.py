"""Side-by-side CPU benchmark: allspark Engine vs transformers generate on the same random weights.

    python benchmarks/bench_engine.py [--quick] [--dtype bfloat16 float32] [--json out.json]

Measured in one run on the same threads: memory bandwidth (a large tensor copy), batch-1 decode
tokens/s for both engines and its ratio to the bandwidth roofline (bandwidth / weight bytes per
token), and throughput with 8 concurrent requests (transformers: one static batch). Prints a table
and writes JSON. Report ratios: absolute times on shared machines are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from allspark_server import Engine, HuggingFaceModel, TargetDevice
from allspark_server.tiny_model import build_tiny_model


def bandwidth_gbs(repeats: int = 5) -> float:
    src = torch.ones(64 << 20, dtype=torch.float32)     # 256 MiB
    dst = torch.empty_like(src)
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / min(best) / 1e9        # read + write


def ours_decode(engine, name, prompt, new_tokens, concurrent=1) -> float:
    gen = {"top_k": 1, "max_new_tokens": new_tokens, "eos_token_id": []}
    t = time.perf_counter()
    handles = [engine.start_request(name, {"input_ids": prompt}, gen) for _ in range(concurrent)]
    for _, h, q in handles:
        while q.Get() is not None:
            pass
        engine.release_request(name, h)
    return concurrent * new_tokens / (time.perf_counter() - t)


def hf_decode(model, prompt, new_tokens, batch=1) -> float:
    x = torch.tensor([prompt] * batch)
    t = time.perf_counter()
    model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, eos_token_id=None, pad_token_id=0)
    return batch * new_tokens / (time.perf_counter() - t)


def median_of(fn, repeats):
    return statistics.median(fn() for _ in range(repeats))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few repeats (smoke check)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--json", default="benchmarks/results.json")
    a = p.parse_args()
    hidden, layers, inter = (512, 4, 1408) if a.quick else (1024, 12, 2816)
    new_tokens, repeats = (32, 3) if a.quick else (64, 5)
    torch.manual_seed(0)
    bw = bandwidth_gbs()
    rows = []
    tmp = tempfile.mkdtemp()
    for dtype in a.dtype:
        d = os.path.join(tmp, dtype)
        build_tiny_model(d, "llama_gqa_llama3", hidden_size=hidden, num_layers=layers, intermediate_size=inter,
                         tokenizer=False, weight_scale=0.02)
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).eval()
        weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed" not in n)
        loader = HuggingFaceModel(d, dtype, user_set_data_type=dtype)
        loader.load_model().serialize(None, model_output_dir=d).free_model()
        engine = Engine()
        engine.install_model(loader.create_reference_runtime_config_builder(dtype, TargetDevice.CPU, [0], 8)
                             .max_length(512).build())
        engine.start_model(dtype)
        prompt = list(range(3, 35))
        ours_decode(engine, dtype, prompt, 4)                       # warm-up
        hf_decode(hf, prompt, 4)
        o1 = median_of(lambda: ours_decode(engine, dtype, prompt, new_tokens), repeats)
        h1 = median_of(lambda: hf_decode(hf, prompt, new_tokens), repeats)
        o8 = median_of(lambda: ours_decode(engine, dtype, prompt, new_tokens, concurrent=8), repeats)
        h8 = median_of(lambda: hf_decode(hf, prompt, new_tokens, batch=8), repeats)
        roof = bw * 1e9 / weight_bytes
        rows.append(dict(dtype=dtype, params_m=round(weight_bytes / hf.dtype.itemsize / 1e6, 1),
                         roofline_tps=roof, ours_b1_tps=o1, hf_b1_tps=h1, ours_b1_vs_roofline=o1 / roof,
                         ours_vs_hf_b1=o1 / h1, ours_c8_tps=o8, hf_c8_tps=h8, ours_vs_hf_c8=o8 / h8))
        engine.stop_model(dtype)
        engine.release_model(dtype)
    print(f"memory bandwidth (copy): {bw:.1f} GB/s, threads: {torch.get_num_threads()}")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"bandwidth_gbs": bw, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
