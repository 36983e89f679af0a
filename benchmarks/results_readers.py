"""How RESULTS.md reads each measure's report: a reader per measure picks the key numbers, mostly same-run ratios.

A reader takes the parsed JSON of one result file and returns either (what, value) pairs, which RESULTS.md shows
with one column per machine, or dicts, one table line each (their keys are the columns). MEASURES gives each
measure its title, the command that makes it and its reader; a measure without one gets `generic`. Only
results_table.py imports this module.
"""
from __future__ import annotations

MACHINES = {
    "zen4": "2-core AMD EPYC VM (Zen 4: AVX-512 with VNNI and bf16, no AMX)",
    "zen5": "2-core AMD EPYC VM (Zen 5, CPU family 26: AVX-512 with VNNI, bf16 and VP2INTERSECT, AVX-VNNI, no AMX)",
    "avx2": "2-core AMD EPYC VM (Zen 3-class: AVX2 only)",
    "spr": "2-core Intel Xeon VM (Sapphire-Rapids-class: AVX-512, AMX)",
    "h100": "1 × NVIDIA H100 80GB HBM3",
    "h100x2": "2 × NVIDIA H100 80GB HBM3 of one host (NVLink)",
    "h200": "1 × NVIDIA H200",
    "h200x2": "2 × NVIDIA H200 of one host (NVLink)",
}


def x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def f(v, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def engines(r: dict) -> list:
    """run.py on the CPU: our Engine against transformers (and a 2-rank pool) per weight dtype."""
    rows = []
    for dtype, d in r["dtypes"].items():
        ours, hf, pool = d["allspark"], d.get("transformers", {}), d.get("pool_2_ranks", {})
        row = {"dtype": dtype, "batch-1 tok/s": f(ours["decode_b1_tps"], 1),
               "of roofline": f(ours["decode_b1_roofline"])}
        if "decode_b1_vs_allspark" in hf:
            row["batch 1 x transformers"] = x(1 / hf["decode_b1_vs_allspark"])
        for c in r["spec"]["concurrency"]:
            if f"c{c}_tps" in ours and f"c{c}_tps" in hf:
                row[f"{c} concurrent x transformers"] = x(ours[f"c{c}_tps"] / hf[f"c{c}_tps"])
        for p in r["spec"]["prompts"]:
            if f"ttft_{p}_s" in ours and f"ttft_{p}_s" in hf:
                row[f"TTFT-{p} transformers / ours"] = x(hf[f"ttft_{p}_s"] / ours[f"ttft_{p}_s"])
        if "decode_b1_vs_allspark" in pool:
            row["2-rank pool / Engine, batch 1"] = x(pool["decode_b1_vs_allspark"])
        rows.append(row)
    return rows


def kv_rows(d: dict, dtype: str) -> list:
    """The --kv rows: decode after a long prompt on int8 / uint4 KV spans against the unquantized cache."""
    rows = []
    for key in sorted(k for k in d if k.startswith("kv_modes")):
        kv = d[key]
        weights = key.removeprefix("kv_modes").removeprefix("_") or dtype
        row = {"weights": f"{weights}, KV after {kv['context']} tokens",
               "unquantized KV tok/s": f(kv["allspark"]["decode_b1_tps"], 1)}
        for mode in ("int8", "uint4"):
            if f"allspark_kv_{mode}" in kv:
                row[f"{mode} KV x unquantized"] = x(kv[f"allspark_kv_{mode}"]["decode_b1_vs_allspark"])
        rows.append(row)
    return rows


def quant(r: dict) -> list:
    """run.py --decode-only with --quant / --ttft / llama.cpp: each variant against the unquantized model."""
    rows = []
    for dtype, d in r["dtypes"].items():
        peers = {}
        for pair, ratio in d.get("vs_llamacpp", {}).items():
            ours, theirs = pair.split("/")
            peers.setdefault(ours, []).append(f"{x(ratio)} {theirs.removeprefix('llamacpp_')}")
        for key, e in d.items():
            if not (key == "allspark" or key.startswith("allspark_")) or "decode_b1_tps" not in e:
                continue
            row = {"weights": dtype if key == "allspark" else key.removeprefix("allspark_"),
                   "batch-1 tok/s": f(e["decode_b1_tps"], 1), "of roofline": f(e["decode_b1_roofline"]),
                   "x unquantized": x(e.get("decode_b1_vs_allspark", 1.0))}
            if key in peers:
                row["x llama.cpp"] = ", ".join(peers[key])
            for p in r["spec"]["prompts"]:
                base = d["allspark"].get(f"ttft_{p}_s")
                if f"ttft_{p}_vs_allspark" in e:
                    row[f"TTFT-{p} x unquantized"] = x(e[f"ttft_{p}_vs_allspark"])
                elif key != "allspark" and base and f"ttft_{p}_s" in e:     # not interleaved: ratio of medians
                    row[f"TTFT-{p} x unquantized"] = x(e[f"ttft_{p}_s"] / base)
            rows.append(row)
        rows += kv_rows(d, dtype)
    return rows


def kv(r: dict) -> list:
    return [row for dtype, d in r["dtypes"].items() for row in kv_rows(d, dtype)]


def features(r: dict) -> list:
    pc, g, pool, mbu = r.get("prefix_cache", {}), r.get("guided_json", {}), r.get("pool_2_ranks", {}), r.get("mbu", {})
    out = []
    if pc:
        out += [("prefix cache: second request on a shared 2048-token prefix, TTFT speedup",
                 x(pc["shared_prefix"]["speedup"])),
                ("prefix cache: multi-turn chat one at a time, TTFT median speedup",
                 x(pc["multi_turn_one_at_a_time"]["ttft_median_speedup"])),
                ("prefix cache: multi-turn chat one at a time, total time speedup",
                 x(pc["multi_turn_one_at_a_time"]["total_speedup"])),
                ("prefix cache: 8 conversations at once, TTFT median speedup",
                 x(pc["multi_turn_concurrent"]["ttft_median_speedup"])),
                ("prefix cache: 8 conversations at once, total time speedup",
                 x(pc["multi_turn_concurrent"]["total_speedup"]))]
    for c in ("c1", "c8"):
        if c in g:
            out.append((f"guided JSON TPOT / plain TPOT, {c[1:]} at once", x(g[c]["ratio"])))
    if pool:
        out += [("2-rank pool: shared-prefix TTFT speedup", x(pool["shared_prefix"]["speedup"])),
                ("2-rank pool: guided JSON TPOT / plain, batch 1", x(pool["guided_c1"]["ratio"]))]
    if mbu:
        out.append(("engine's reported MBU / the benchmark's roofline ratio", x(mbu["engine_vs_benchmark"])))
    return out


def moe(r: dict) -> list:
    d, c = r["decode_b1"], r["spec"]["concurrency"]
    return [("batch-1 tok/s", f(d["allspark"]["decode_b1_tps"], 1)),
            ("of active-parameter roofline", f(d["allspark"]["decode_b1_roofline"])),
            ("batch 1 x transformers", x(1 / d["transformers"]["decode_b1_vs_allspark"])),
            (f"{c} concurrent x transformers", x(r[f"concurrent_{c}"]["ratio"]))]


def multi_host(r: dict) -> list:
    return [("2-host pool / 1-host pool, batch-1 decode", x(r["two_hosts_over_one_host"])),
            ("same greedy tokens", "yes" if r["same_greedy_tokens"] else "no")]


def serve(r: dict) -> list:
    out = []
    if "http_vs_engine_sequential" in r:
        s = r["http_vs_engine_sequential"]
        out += [("one at a time: TTFT added by HTTP (ms)", f(s["ttft_median_added_ms"], 1)),
                ("one at a time: TPOT HTTP / Engine API", x(s["tpot_median_ratio"]))]
    p = r["http_vs_engine"]
    return out + [("Poisson load: TTFT median added by HTTP (ms)", f(p["ttft_median_added_ms"], 1)),
                  ("Poisson load: TPOT median HTTP / Engine API", x(p["tpot_median_ratio"])),
                  ("Poisson load: output tok/s HTTP / Engine API", x(p["output_throughput_ratio"]))]


def serve_burst(r: dict) -> list:
    runs = {k: v for k, v in r.items() if isinstance(v, dict) and "burst" in v} or {"run": r}
    return [{"run": name, "streams": str(v["burst"]["requests"]), "server args": v.get("server_args") or "defaults",
             "ended": ", ".join(f"{n} {how}" for how, n in sorted(v["burst"]["ended"].items())),
             "wall s": f(v["burst"]["wall_s"], 1)} for name, v in runs.items()]


def cpu_attention(r: dict) -> list:
    return [{"context": ctx, "bf16 ms per 16 layers": f(row["bf16"]["ms_per_step"], 3),
             **{f"{m} x bf16": x(row[m]["bf16_over_this"]) for m in ("int8", "uint4") if m in row}}
            for ctx, row in r["results"].items()]


def int8_gemm(r: dict) -> list:
    return [{"prompt": p, "int8 GEMM TTFT x bf16": x(t["int8_gemm_vs_bf16"]),
             "dequantized TTFT x bf16": x(t["dequantized_vs_bf16"]),
             "int8 GEMM / dequantized": x(t["int8_gemm_vs_dequantized"])} for p, t in r["ttft"].items()]


def quant_accuracy(r: dict) -> list:
    kinds = list(r["stats"])
    rows = []
    for variant in r["stats"][kinds[0]]:
        row = {"variant": variant}
        for kind in kinds:
            s = r["stats"][kind].get(variant)
            if s:
                row[f"{kind}: rel. logit error"] = f"{100 * s['rel_logit_error']:.1f}%"
                row[f"{kind}: top-1 agreement"] = f"{100 * s['top1_agreement']:.0f}%"
        rows.append(row)
    return rows


def accuracy_smollm2(r: dict) -> list:
    """accuracy_table.py: per weight format, perplexity, mean KL against fp32 and top-1 agreement per KV mode."""
    rows = {"ref": {"weights": "transformers fp32 (the reference)", "PPL, dense KV": f(r["reference"]["ppl"], 3)}}
    for e in r["rows"]:
        row = rows.setdefault(e["weights"], {"weights": e["weights"]})
        kv = e["kv"]   # dense (the model's dtype), int8, uint4
        row[f"PPL, {kv} KV"] = f(e["ppl"], 3)
        row[f"KL, {kv} KV"] = f"{e['kl_mean']:.4f}"
        row[f"top-1, {kv} KV"] = f"{100 * e['top1_agreement']:.1f}%"
    return list(rows.values())


def switch_interval(r: dict) -> list:
    m = r["medians"]
    out = []
    for c in sorted({k.rsplit("_c", 1)[1] for k in m}, key=int):
        runs = {k.rsplit("ms_c", 1)[0]: v for k, v in m.items() if k.endswith(f"_c{c}")}
        (a, va), (b, vb) = sorted(runs.items(), key=lambda kv: -float(kv[0]))[:2]
        out.append((f"{c} concurrent, decode-only tok/s: {b} ms / {a} ms switch interval",
                    x(vb["decode_tps"] / va["decode_tps"])))
    return out


def ab_trees(r: dict) -> list:
    """ab_trees.py: each variant's median same-round ratio of the new tree's batch-1 decode over the old one's."""
    runs = r.get("turns") or r["rounds"]
    rows = [(f"{v}: new / old batch-1 decode tok/s ({len(runs[v]['new'])} paired runs, old {r['trees']['old']})",
             f(ratio, 3)) for v, ratio in r["median_ratio"].items()]
    if "repeat_bf16" in r:
        rows.append((f"bf16 again, a later run ({len(r['repeat_bf16']['turns']['new'])} paired runs)",
                     f(r["repeat_bf16"]["median_ratio"], 3)))
    for run in r.get("later_bf16_runs", {}).get("runs", []):
        rows.append((f"bf16, {r['later_bf16_runs']['note']} ({len(run['turns']['new'])} paired runs)",
                     f(run["median_ratio"], 3)))
    for run in r.get("more_runs", []) + ([r["control"]] if "control" in r else []):
        rows += [(f"{v}, {run['note']} ({len(run['turns'][v]['new'])} paired runs)", f(ratio, 3))
                 for v, ratio in run["median_ratio"].items()]
    rows += [(f"{v}: every run's paired ratios pooled ({r['pooled_turns'][v]})", f(ratio, 3))
             for v, ratio in r.get("pooled_median_ratio", {}).items()]
    return rows


def batch_invariance(r: dict) -> list:
    """batch_invariance.py: per model, batch-invariant mode on against off (medians of same-round ratios; TTFT as
    on's time / off's) and how many concurrent greedy requests differ from their solo run in each mode."""
    rows = []
    for model, m in r["models"].items():
        ratios, differ, n = m["on_over_off"], m["differ_from_solo"], m["of_requests"]
        rows.append({"model": model, "batch-1 decode on / off": x(ratios["decode_b1_tps"]),
                     f"{r['streams']} streams tok/s on / off": x(ratios[f"c{r['streams']}_tps"]),
                     f"{r['streams']} streams decode-only on / off": x(ratios.get(f"c{r['streams']}_decode_tps")),
                     "TTFT-512 time on / off": x(ratios["ttft_512_s"]),
                     "differ from solo, off": f"{differ['off']}/{n}", "differ from solo, on": f"{differ['on']}/{n}"})
    return rows


def gguf_race(r: dict) -> list:
    """gguf_race.py: per GGUF file, ours against llama.cpp on the same file and threads (medians of same-round ratios,
    > 1: ours faster) and the rounds they come from; the cores other processes took during the rounds."""
    rows = []
    for key, rep in r["files"].items():
        rows += [(name, x(v)) for name, v in r.items() if name.startswith(f"{key}: ")]   # gguf_race.finish's
        rows.append((f"{key}: quiet rounds used / run", f"{len(rep.get('rounds_used', rep['rounds']))} / "
                                                        f"{len(rep['rounds'])}"))
    return rows + [("other processes' cores (median)", f(r.get("other processes' cores during the rounds (median)")))]


def prefill_attention(r: dict) -> list:
    """prefill_attention_micro.py: per dtype and prompt length, the native kernel against ATen's SDPA."""
    return [{"case": case, "native ms": f(v["native_ms"], 2), "SDPA ms": f(v["sdpa_ms"], 2),
             "SDPA / native": x(v["sdpa_over_native"]), "native GFLOP/s": f(v["native_gflops"], 0)}
            for case, v in r["results"].items()]


def prefill_gemm(r: dict) -> list:
    """prefill_gemm.py: per row count and variant, multiply-adds per second, speed over the dequantized GEMM of the
    same format (same rounds) and share of the instruction's peak."""
    return [{"rows": rows, "variant": name, "GMAC/s": f(v["macs_per_s"] / 1e9, 0),
             "x dequantized": x(v["over_dequantized"]) if "native" in name else "",
             "of peak": "" if v["of_peak"] is None else f"{v['of_peak']:.0%}"}
            for rows, variants in r["rows"].items() for name, v in variants.items()]


def speculative(r: dict) -> list:
    """speculative.py: per speculative variant, its output tokens/s over plain decoding's (medians of same-round
    ratios), its acceptance rate and whether its greedy outputs equalled plain decoding's."""
    rows = []
    for key, ratios in r.items():
        if not key.endswith("_over_plain"):
            continue
        name = key[:-len("_over_plain")]
        ref = r.get("greedy_compared_with", "plain")      # on a GPU: the plain model in batch-invariant mode
        model = r["model"] + (f" {r['dtype']}" if r.get("dtype", "bfloat16") != "bfloat16" else "")
        if name == ref:
            equal = "(the reference)"
        else:
            unequal = [w for w, ok in r["greedy_equal"].get(name, r["greedy_equal"]).items() if not ok]
            equal = ("yes" if not unequal else "no: " + ", ".join(unequal)) + (f" ({ref})" if ref != "plain" else "")
        rows.append({"variant": name, "model": model, "rewrite, batch 1": x(ratios["rewrite_tps"]),
                     "free text, batch 1": x(ratios["free_tps"]),
                     f"{r.get('streams', 32)} streams": x(ratios["streams_tps"]),
                     "acceptance": f(r.get(f"{name}_acceptance_rate", r.get("acceptance_rate"))),
                     "greedy equal to plain": equal})
    return rows


def lora(r: dict) -> list:
    """lora.py: a request with a rank-r adapter on all seven projections over the base model's batch-1 tokens/s, the
    LoRA-enabled model without an adapter over the base, and N streams over M adapters over the same streams on the
    base, whole and (where measured) their decode steps alone (medians of same-round ratios)."""
    d, s = r["decode_b1"], r["streams_total"]
    model = r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else "")
    return [{"model": model, "dtype": r["dtype"], "rank": r["rank"],
             "batch 1, adapter": x(d["adapter_over_base"]), "batch 1, no adapter": x(d["lora_model_base_over_base"]),
             f"{r['streams']} streams over {r['adapters']} adapters": x(s["adapters_over_base"]),
             "their decode steps alone": x(r["streams_decode_steps"]["adapters_over_base"])
             if r.get("streams_decode_steps") else "",
             "adapter changes the output": "yes" if r["adapter_changes_output"] else "no",
             "greedy equal without adapter": "yes" if r["lora_model_base_greedy_equal"] else "no"}]


def vl(r: dict) -> list:
    """vl.py: N concurrent single-image requests, our Engine against transformers' batched generate in the same run
    (TTFT: ours per request, transformers' the batch's generate(max_new_tokens=1); throughput: all generated tokens
    over wall time; ratios are medians of same-round ratios), and the turn-2 TTFT of a multi-turn chat about the same
    image (a prefix-cache hit) against the same ids with a fresh image."""
    c, m = r["concurrent"], r["multi_turn"]
    ours, hf = c["allspark"], c["transformers"]
    return [{"model": r["model"], "workload": f"{r['requests']} x {r['image_size']}px image, {r['tokens']} tokens",
             "TTFT median / p90 (ms)": f"{ours['ttft_median_s'] * 1e3:.0f} / {ours['ttft_p90_s'] * 1e3:.0f}",
             "transformers TTFT (ms)": f(hf["ttft_median_s"] * 1e3, 0),
             "TTFT transformers / ours": x(c["transformers_ttft_over_allspark_median"]),
             "tok/s": f(ours["tokens_per_s"], 0), "transformers tok/s": f(hf["tokens_per_s"], 0),
             "tok/s ours / transformers": x(c["allspark_tps_over_transformers"]),
             "turn-2 TTFT hit / fresh image (ms)": f"{m['turn2_ttft_hit_s'] * 1e3:.0f} / "
                                                   f"{m['turn2_ttft_miss_s'] * 1e3:.0f}",
             "fresh / hit": x(m["miss_over_hit"]),
             "cached tokens on the hit": str(int(m["hit_prefix_cache_tokens"]))}]


def speculative_verify(r: dict) -> list:
    """speculative_verify_cost.py: per model and context length, a decode graph's replay time at each row count over
    one row's, and the verify graph's of k + 1 = 5 rows at batch 1 (alone-rows mode), where the run has one."""
    rows = []
    for model, m in r["models"].items():
        for ctx, c in m["by_ctx"].items():
            verify = c["over_size1"].get("v5")
            plain = c.get("over_plain_size1", {}).get("v5")
            rows.append({"model": model, "context": ctx, "1 row (ms)": f(c["ms"]["1"], 3),
                         **{f"{n} rows / 1": x(c["over_size1"].get(n)) for n in ("2", "4", "5", "8")},
                         "verify graph, 5 rows / 1": x(verify),
                         "verify / plain model's 1 row": x(plain) if plain else "-"})
    return rows


def generic(r) -> list:
    """A measure without a reader: its top-level numbers."""
    if not isinstance(r, dict):
        return [("entries", str(len(r)))]
    return [(k, f(v, 3)) for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:20]


# measure -> (title, what it is, reader); the order of RESULTS.md
