"""The results table's readers of the GPU measures (results_readers.py has the others and the shared formatting)."""
from __future__ import annotations

from results_readers import f, x


def cuda(r: dict) -> list:
    """run.py --device cuda: the Engine on the GPU against the PyTorch CUDA-graph step and transformers."""
    out = [("batch-1 tok/s", f(r["allspark_decode_b1_tps"], 1)),
           ("of copy roofline", f(r["allspark_decode_b1_roofline"])),
           ("batch 1 x PyTorch CUDA-graph step", x(r["allspark_vs_torch_cuda_graph"]))]
    for name, label in (("no_pdl", "without PDL"), ("unfused_decode", "with unfused decode attention"),
                        ("cublas", "with cuBLAS linears")):
        if f"allspark_vs_{name}_b1" in r:
            out.append((f"batch 1 x the same graphs {label}", x(r[f"allspark_vs_{name}_b1"])))
    if "overlap_vs_no_overlap_b1" in r:
        out.append(("batch 1 overlapped x one step at a time", x(r["overlap_vs_no_overlap_b1"])))
    for v, q in r.get("quant", {}).items():
        if isinstance(q, dict) and "vs_bf16" in q:
            out.append((f"batch 1 {v} x bf16", x(q["vs_bf16"])))
    pool = r.get("pool2", {})
    for key, label in (("pool_2gpu_overlap_vs_1gpu", "overlapped"), ("pool_2gpu_vs_1gpu", "one step at a time"),
                       ("pool_vs_1gpu", "one step at a time")):
        if key in pool:
            out.append((f"2-GPU pool ({label}) x one GPU, batch 1", x(pool[key])))
    for p, t in r.get("ttft", {}).items():
        out.append((f"TTFT-{p} transformers / ours", x(t["hf_vs_allspark"])))
    for c in (16, 64, 128, 256):
        if f"c{c}" in r:
            out.append((f"{c} concurrent, decode-only x PyTorch graph step",
                        x(r[f"c{c}"]["allspark_decode_vs_torch_cuda_graph"])))
            if "one_loop_readers" in r[f"c{c}"]:
                out.append((f"{c} concurrent read on one asyncio loop, decode-only x PyTorch graph step",
                            x(r[f"c{c}"]["one_loop_readers"]["decode_vs_torch_cuda_graph"])))
            out.append((f"{c} concurrent, whole run x transformers static batch",
                        x(r[f"c{c}"]["allspark_vs_hf_static"])))
    return out


def cuda_gemv_micro(r: dict) -> list:
    rows = []
    for shape, by_rows in r["rows"].items():
        row = {"shape": shape, **{f"{m.removeprefix('m')} row(s): Triton GEMV x cuBLAS": x(v["triton_vs_cublas"])
                                  for m, v in by_rows.items()}}
        if "fused_vs_cublas_silu_mul" in by_rows.get("m1", {}):
            row["1 row, with silu·mul: fused x cuBLAS + silu_mul"] = x(by_rows["m1"]["fused_vs_cublas_silu_mul"])
        rows.append(row)
    return rows


def cuda_gemv_sweep(r: dict) -> list:
    """cuda_gemv_micro.py --sweep: per shape, the tile choose_config gave when it ran and its time, and the best."""
    rows = []
    for shape, sw in r["sweep"].items():
        timed = {tuple(cfg): us for us, _, cfg in sw["best"] + sw["worst"]}
        chosen = tuple(sw["chosen"])
        m1 = r["rows"].get(shape.removesuffix("_silu_mul"), {}).get("m1", {})
        us = timed.get(chosen, m1.get("fused_silu_mul_us" if shape.endswith("_silu_mul") else "triton_us"))
        best_us, _, best = sw["best"][0]
        rows.append({"shape": shape, "tile then (rows, k, warps, stages)": str(list(chosen)),
                     "its µs": f(us, 2), "best tile": str(best), "best µs": f(best_us, 2)})
    return rows


def cuda_gemv_lora(r: dict) -> list:
    """cuda_gemv_micro.py --lora-sweep: per shape, the tile choose_config gave when it ran, its time alone, with the
    adapter's shrink and expand, and the fastest tile with them."""
    rows = []
    for shape, sw in r["lora_sweep"].items():
        by_tile = {tuple(t["tile"]): t for t in sw["tiles"]}
        mine, best = by_tile.get(tuple(sw["chosen"]), {}), sw["tiles"][0]
        rows.append({"shape": shape, "rank": sw["rank"], "tile then": str(sw["chosen"][:2]),
                     "alone µs": f(mine.get("plain_us"), 2), "with the adapter µs": f(mine.get("lora_us"), 2),
                     "silu·mul µs": f(mine.get("silu_mul_us"), 2),
                     "fastest (with the adapter)": str(best["tile"][:2]),
                     "its µs": f(best.get("lora_us", best["plain_us"]), 2)})
    return rows


def lora_kernels_micro(r: dict) -> list:
    """A row per batch: the projections' graph replay time without adapters, and base / each variant."""
    return [{"rows": key.removeprefix("rows_"), "base ms": f"{v['ms']['base']:.3f}",
             **{f"{name}: base / it": x(ratio) for name, ratio in v["base_over"].items() if name != "base"}}
            for key, v in r.items() if key.startswith("rows_")]


def cuda_quant_micro(r: dict) -> list:
    rows = []
    for key, v in r["rows"].items():
        shape, m = key.rsplit("_m", 1)
        if m in ("1", "16", "2048"):
            rows.append({"shape": shape, "rows": m, **{f"{k.removesuffix('_vs_bf16')} x cuBLAS bf16": x(val)
                                                        for k, val in v.items() if k.endswith("_vs_bf16")}})
    return rows


def cuda_fp8(r: dict) -> list:
    """fp8 weights at batch 1, fp8 KV spans at 32 x 4k and W8A8 at 128 requests against bf16, and the fp8 GEMV's
    silu·mul A/B."""
    rows = []
    bf16_ms = r.get("bf16", {}).get("graph_replay_ms_b1")
    for name, v in r.get("b1", {}).items():
        if name == "decode_b1_tps_by_round":
            continue
        rows.append((f"batch 1, {name} weights: tokens/s x bf16 ({f(v['decode_b1_tps'], 0)} tokens/s)",
                     x(v["vs_bf16"])))
        if bf16_ms:
            rows.append((f"batch 1, {name}: graph replay, bf16's / its", x(bf16_ms / v["graph_replay_ms_b1"])))
        rows.append((f"batch 1, {name}: first greedy token that differs from bf16's",
                     str(v["greedy_first_divergence_vs_bf16"])))
    if "kv" in r:
        kv = r["kv"]
        rows.append((f"fp8 KV spans x bf16 spans: decode tokens/s, {kv['batch']} requests of {kv['context']} tokens",
                     x(kv["fp8_vs_bf16_decode"])))
    if "w8a8" in r:
        w = r["w8a8"]
        rows.append((f"W8A8 (fp8 weights and activations) x bf16, {w['batch']} requests, a thread each: decode "
                     "tokens/s",
                     x(w["w8a8_vs_bf16_decode"])))
        if "w8a8_vs_bf16_decode_one_loop" in w:
            rows.append((f"W8A8 x bf16, {w['batch']} requests read on one loop: decode tokens/s",
                         x(w["w8a8_vs_bf16_decode_one_loop"])))
        rows.append((f"W8A8 x bf16, {w['batch']} requests: graph replay, bf16's / its", x(w["w8a8_vs_bf16_graph"])))
    if "silu_ab" in r:
        ab = r["silu_ab"]
        rows.append(("fp8 gate_up GEMV with silu·mul epilogue x two launches (batch 1, tokens/s)",
                     x(ab["fused_vs_bf16"] / ab["unfused_vs_bf16"])))
    return rows


def cuda_quant_sweep(r: dict) -> list:
    return [{"shape and format": key, "best µs": f(v["best"][0][0]), "chosen config µs": f(v["chosen_us"]),
             "best / chosen time": x(v["best"][0][0] / v["chosen_us"]), "best GB/s": f(v["gbs_best"], 0)}
            for key, v in r["sweep"].items()]


def cuda_quant_silu(r: dict) -> list:
    return [(f"{shape}: GEMV with silu·mul epilogue x GEMV + silu_mul", x(v["fused_vs_unfused"]))
            for shape, v in r.items()]


def decode_attention_sweep(r: dict) -> list:
    rows = []
    for shape, runs in r.items():
        best = runs[0]
        default = next((s for s in runs if (s["block_n"], s["warps"], s["stages"], s["splits"]) == (64, 4, 3, 1)), None)
        rows.append({"shape": shape, "best (block_n, warps, stages, splits)":
                     f"{best['block_n']}, {best['warps']}, {best['stages']}, {best['splits']}",
                     "best TB/s": f(best["tbs"]),
                     "best x (64, 4, 3, 1)": x(default["ms"] / best["ms"]) if default else ""})
    return rows


def allreduce(r: dict) -> list:
    out = []
    for rows, v in r["rows"].items():
        for key, label in (("peer_kernel", "peer-memory kernel"), ("peer_sentinel", "peer-memory kernel, sentinel"),
                           ("peer_flags", "peer-memory kernel, flags"), ("one_shot", "PyTorch symm-mem one-shot"),
                           ("two_shot", "PyTorch symm-mem two-shot")):
            if f"{key}_us" in v:
                out.append((f"[{rows}, {r['hidden']}] bf16: NCCL time / {label} time",
                            x(v["nccl_us"] / v[f"{key}_us"])))
    return out


def pool_step(r: dict) -> list:
    peer = r["peer_allreduce"]["graph_replay_ms_by_rank"][0]
    others = (("nccl", "NCCL"), ("peer_flags", "the flags protocol"),
              ("peer_sentinel_unfused", "the sentinel protocol, the norm a launch of its own"))
    rows = [(f"rank's graph with {label} / with the default peer-memory allreduce",
             x(r[key]["graph_replay_ms_by_rank"][0] / peer)) for key, label in others if key in r]
    return rows + [("one GPU's graph / a rank's graph (default peer-memory allreduce)",
                    x(r["one_gpu"]["graph_replay_ms_by_rank"][0] / peer))]
