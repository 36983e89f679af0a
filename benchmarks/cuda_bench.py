"""The GPU benchmark (`python benchmarks/run.py --device cuda`): allspark's Engine on one GPU against the
plain-PyTorch CUDA-graph decode step (torch_cuda_peer.py) on the same random Llama-2-7B-shaped bf16 weights.

Measures the device's copy bandwidth (device-to-device, bytes read + written) for the roofline, checks the
peer and the Engine against transformers, then batch-1 decode of both interleaved round by round. --quick
shrinks the model to 8 layers so that one device call holds everything; --smoke to two narrow layers
(cuda_common.SMOKE_SHAPE) and one round of every row, which checks that they all run. Writes JSON.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch_cuda_peer as peer_mod
import workloads as W
from cuda_common import (
    CONC_NEW,
    CONC_PROMPT,
    LLAMA2_7B,
    MEMORY_GB,
    bench_root,
    bench_shape,
    build_model,
    copy_bandwidth_gbs,
    first_divergence,
    free_memory,
    graph_replay_ms,
    kernel_breakdown,
    kv_bytes_per_token,
    note_memory,
    overlap_off,
    recaptured_graphs,
    serialized_bench_model,
)
from cuda_rows import concurrent_rows, poisson_row, quant_rows, ttft_rows, two_gpu_pool_rows

from allspark_client import settings

# what a run measures after the batch-1 rows (`run.py --device cuda --sections ...`; --quant adds its rows)
SECTIONS = ("ttft", "pool", "concurrency", "poisson")
# the batch-1 rounds' A/B graph variants: name -> the switch set to 0 when they are captured
GRAPH_VARIANTS = {"cublas": settings.TRITON_GEMV, "no_pdl": settings.PDL, "unfused_decode": settings.FUSED_DECODE}


def main(args, save=lambda report: None) -> dict:
    """The report; `save(report)` is called after each section, so a failure later keeps what was measured."""
    from transformers import AutoModelForCausalLM

    from allspark_server import Engine
    smoke = getattr(args, "smoke", False)
    shape = bench_shape(8 if args.quick else LLAMA2_7B["num_hidden_layers"], smoke)
    new_tokens, prompt_len, rounds = (8, 16, 1) if smoke else (64, 32, 3) if args.quick else (128, 32, 5)
    # 256 concurrent (with the peer's static cache and transformers beside) needs an H200's memory
    big = torch.cuda.get_device_properties(0).total_memory > 120e9
    concurrency = (4,) if smoke else (16,) if args.quick else (16, 64, 128, 256) if big else (16, 64, 128)
    sections = set(getattr(args, "sections", None) or SECTIONS)
    if "concurrency" not in sections:   # no graphs of a batch that nothing runs (their capture takes a while)
        concurrency = (8,)
    root = bench_root(shape)
    t0 = time.perf_counter()
    build_model(root, shape)
    report = {"device": torch.cuda.get_device_name(), "layers": shape["num_hidden_layers"],
              "copy_gbs": copy_bandwidth_gbs(256 << 20 if smoke else 2 << 30)}
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16).to("cuda").eval()
    nbytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    report["weight_bytes_per_token"] = nbytes
    report["roofline_tps"] = report["copy_gbs"] * 1e9 / nbytes
    prompt = W.prompt(prompt_len, 0, LLAMA2_7B["vocab_size"])
    report["peer_vs_hf_rel_err"] = peer_mod.check_against_hf(hf, prompt)
    report["memory_gb"] = MEMORY_GB
    note_memory("hf")
    weights = peer_mod.StaticWeights(hf)
    peer = peer_mod.StaticLlama(weights, batch=1, max_len=prompt_len + new_tokens + 8)
    peer.prefill_by_decoding(prompt)
    peer.capture()

    loader = serialized_bench_model(root)
    engine = Engine()
    ttft_lens = (16, 64) if smoke else (128, 512) if args.quick else (128, 512, 2048)
    max_len = max(max(prompt_len, CONC_PROMPT) + max(new_tokens, CONC_NEW), max(ttft_lens)) + 16
    max_batch = max(concurrency)
    kv_tokens = max(max_batch * (CONC_PROMPT + CONC_NEW + 32), max_len + 32)
    kv_bytes = kv_tokens * kv_bytes_per_token(shape)                       # just enough
    cfg = (loader.create_reference_runtime_config_builder("bench-cuda", "cuda", [0], max_batch=max_batch)
           .max_length(max_len).kv_cache_span_size(32).kv_cache_memory(kv_bytes).build())
    engine.install_model(cfg)
    engine.start_model("bench-cuda")
    note_memory("hf+peer+engine")
    report["setup_s"] = time.perf_counter() - t0

    # our greedy tokens against transformers' (both bf16; a random model's near-ties can split them)
    ours = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    theirs = out[0, prompt_len:].tolist()
    report["greedy_ours_hf"] = [ours, theirs]
    report["greedy_first_divergence"] = first_divergence(ours, theirs)

    runs = {"allspark": [], "torch_cuda_graph": [], "allspark_no_overlap": []}
    served = engine._engine.models["bench-cuda"]
    # A/B: the same engine's decode graphs captured again with every dense linear on cuBLAS, without
    # programmatic dependent launch (cuda/pdl.py), and with rotary, attention and split combine as three
    # launches (decode_attention.fused_decode_enabled); swapped in as runner.graphs between requests
    ours_graphs = served.runner.graphs
    variants = {name: recaptured_graphs(served.runner, {var: False}) for name, var in GRAPH_VARIANTS.items()}
    runs.update({f"allspark_{name}": [] for name in variants})
    W.decode_tps(engine, "bench-cuda", LLAMA2_7B["vocab_size"], 8)

    def ours(seed):
        return W.decode_tps(engine, "bench-cuda", LLAMA2_7B["vocab_size"], new_tokens, seed=seed,
                            prompt_len=prompt_len)
    for r in range(rounds):
        runs["allspark"].append(ours(r))
        runs["torch_cuda_graph"].append(peer.decode_tps(prompt_len, new_tokens))
        with overlap_off(served):   # the same engine stepping one step at a time (ALLSPARK_OVERLAP=0)
            runs["allspark_no_overlap"].append(ours(r))
        for name, graphs in variants.items():
            served.runner.graphs = graphs
            runs[f"allspark_{name}"].append(ours(r))
        served.runner.graphs = ours_graphs
    overlap = runs.pop("allspark_no_overlap")
    others = {name: runs.pop(f"allspark_{name}") for name in variants}
    for name, tps in others.items():
        report[f"allspark_vs_{name}_b1"] = statistics.median(a / b for a, b in zip(runs["allspark"], tps))
        report[f"allspark_{name}_decode_b1_tps"] = statistics.median(tps)
        report[f"graph_replay_ms_b1_{name}"] = graph_replay_ms(variants[name], 1)
    del variants
    for name, tps in runs.items():
        report[f"{name}_decode_b1_tps"] = statistics.median(tps)
        report[f"{name}_decode_b1_roofline"] = statistics.median(tps) / report["roofline_tps"]
    report["decode_b1_tps_by_round"] = dict(runs, allspark_no_overlap=overlap,
                                            **{f"allspark_{n}": t for n, t in others.items()})
    report["allspark_vs_torch_cuda_graph"] = statistics.median(a / b for a, b in zip(*runs.values()))
    report["overlap_vs_no_overlap_b1"] = statistics.median(a / b for a, b in zip(runs["allspark"], overlap))
    report["graph_replay_ms_b1"] = graph_replay_ms(served.runner.graphs, 1)
    report["host_overhead_ms_b1"] = 1e3 / report["allspark_decode_b1_tps"] - report["graph_replay_ms_b1"]
    report["kernels_b1"] = kernel_breakdown(served.runner, 1, top=16)
    del peer
    free_memory()
    note_memory("after batch 1")
    save(report)
    # the pools first: the quantized models leave cached GPU memory behind that a pool's rank 0 would need
    if torch.cuda.device_count() >= 2 and not args.no_pool and "pool" in sections:
        report["pool2"] = two_gpu_pool_rows(engine, loader, prompt_len, new_tokens, rounds)
        print(f"2-GPU pool: {report['pool2']}", flush=True)
        save(report)
    if "ttft" in sections:
        report["ttft"] = ttft_rows(engine, hf, ttft_lens)
        print(f"TTFT: {report['ttft']}", flush=True)
        save(report)
    if getattr(args, "quant", None):
        report["quant"] = quant_rows(engine, root, args.quant, prompt_len, new_tokens, rounds, max_len, shape)
        print(f"quantized weights: {report['quant']}", flush=True)
        save(report)
    for c in concurrency if "concurrency" in sections else ():
        report[f"c{c}"] = concurrent_rows(engine, hf, weights, c)
        print(f"concurrency {c}: {report[f'c{c}']}", flush=True)
        save(report)
    if "poisson" in sections:
        report["poisson"] = poisson_row(engine, 4 if smoke else 32 if args.quick else 128)
        print(f"Poisson arrivals: {report['poisson']}", flush=True)
    engine.stop_model("bench-cuda")
    engine.release_model("bench-cuda")
    return report
