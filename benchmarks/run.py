"""allspark's benchmark: one command, one run, everything side by side on the same machine and threads.

    python benchmarks/run.py [--quick] [--features] [--decode-only] [--dtypes bfloat16 float32] [--quant int8 int4_g32]
                             [--kv int8 uint4 [--kv-weights int4_g64]] [--json PATH]

Measures the machine (STREAM-like copy/triad bandwidth, fp32/bf16 matmul rate), then for each
weight dtype, on a Llama-architecture model with random weights (about 0.5 B parameters; --quick:
a small one): batch-1 decode tokens/s and its ratio to the roofline (copy bandwidth / bytes read
per token; the engines' decode runs are interleaved round by round so they share the machine's
phases, and each round's bandwidth is measured around its runs), TTFT for 128/512/2048-
token prompts, throughput with 8 and 32 concurrent requests (128 in / 128 out, EOS ignored) and
with Poisson arrivals (TTFT / TPOT median and p99) — for our Engine, for transformers' generate
(static batches for the concurrent case) and for a 2-rank pool through ClientEngine on the same
cores. With --quant, the same weights quantized with InstantQuant (e.g. int8 = int8 per channel,
int4_g32 = int4 in groups of 32) are served by the same Engine and join the interleaved batch-1 decode
rounds (their roofline counts the bytes their files hold) and TTFT rounds interleaved the same way with the
unquantized model's (`ttft_<p>_vs_allspark`: medians of same-round ratios). With llama-cpp-python and
gguf installed (--no-llamacpp skips it), llama.cpp decodes the same weights as GGUF files in the same
rounds: f16 and bf16 next to bf16 (f32 next to fp32), q8_0 next to int8, q4_0 next to the 4-bit variants
(`vs_llamacpp`: ours / theirs, medians of same-round ratios). With --kv, batch-1 decode after a 2048-token
prompt with int8 / uint4 KV spans is interleaved with the same decode on the unquantized cache (--kv-weights: also
on one of the --quant variants, where the cache is a larger share of a token's bytes). Prints a table and writes
JSON. Compare ratios from one run: absolute numbers on shared machines are noisy.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional

# transformers runs in this process next to the Engine, whose engine thread uses OpenMP too (prefill
# GEMMs): libgomp then manages more threads than there are CPUs and stops letting idle workers spin, so
# each of transformers' parallel regions waits for a wake-up (its batch-1 decode measured ~10% slower
# here), an artefact of sharing the process. Bounded spinning for every OpenMP team gives transformers
# (and our prefill) their best case; our decode kernels run on allspark's own pool and do not depend on
# it. Must be set before torch loads libgomp; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "300000")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import llamacpp_peer as LP  # noqa: E402
import machine  # noqa: E402
import workloads as W  # noqa: E402

FULL = dict(hidden_size=1536, num_layers=16, intermediate_size=4096, num_heads=12, num_kv_heads=4, vocab=32000,
            new_tokens=128, prompts=(128, 512, 2048), repeats=5, decode_repeats=7, concurrency=(8, 32), poisson_n=32,
            kv_context=2048)   # kv_context: the --kv rows' prompt length
QUICK = dict(hidden_size=512, num_layers=4, intermediate_size=1408, num_heads=8, num_kv_heads=4, vocab=8000,
             new_tokens=32, prompts=(128, 512), repeats=2, decode_repeats=3, concurrency=(8,), poisson_n=8,
             kv_context=512)


def build_model(spec: dict, dtype: str) -> str:
    from allspark_server.loader.tiny_model import build_tiny_model
    key = "-".join(str(spec[k]) for k in ("hidden_size", "num_layers", "intermediate_size", "vocab"))
    d = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench", f"{key}-{dtype}")
    if not os.path.exists(os.path.join(d, "config.json")):
        build_tiny_model(d, "llama_gqa_llama3", seed=0, hidden_size=spec["hidden_size"],
                         num_layers=spec["num_layers"], intermediate_size=spec["intermediate_size"],
                         num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"], vocab_size=spec["vocab"],
                         max_position_embeddings=4096, weight_scale=0.02, dtype=dtype, tokenizer=False)
    return d


def bytes_per_token(hf_model, spec: dict, ctx: int) -> int:
    """Weights read for one decode token (the embedding table contributes one row) + the KV cache."""
    total = 0
    for name, p in hf_model.named_parameters():
        total += p.element_size() * (p.shape[-1] if "embed_tokens" in name else p.numel())
    if hf_model.config.tie_word_embeddings:
        total += hf_model.model.embed_tokens.weight.numel() * hf_model.model.embed_tokens.weight.element_size()
    head_dim = spec["hidden_size"] // spec["num_heads"]
    kv = 2 * spec["num_layers"] * ctx * spec["num_kv_heads"] * head_dim * hf_model.dtype.itemsize
    return total + kv


def quant_variant(name: str) -> dict:
    """'int8' -> int8 per channel; 'uint4_g32' -> uint4 in groups of 32; suffixes: '+head' quantizes the LM
    head too, '+a8' computes with int8 activations (compute_method activate_quant); the customized_quant_config."""
    base, *suffixes = name.split("+")
    unknown = set(suffixes) - {"head", "a8"}
    if unknown:
        raise SystemExit(f"--quant {name}: unknown suffix {sorted(unknown)} (known: +head, +a8)")
    fmt, _, group = base.partition("_g")
    return {"weight_format": fmt, "group_size": int(group) if group else -1, "quantize_lm_head": "head" in suffixes,
            "compute_method": "activate_quant" if "a8" in suffixes else "weight_only"}


def file_bytes_per_token(weights_path: str, ctx_bytes: int) -> int:
    """Bytes a decode token reads from a serialized model: every stored tensor once, the embedding one row
    (tied LM heads are read from it in full), plus the KV cache bytes `ctx_bytes`."""
    from safetensors import safe_open
    total = 0
    with safe_open(weights_path, framework="pt") as f:
        names = set(f.keys())
        for name in names:
            sl = f.get_slice(name)
            shape, size = sl.get_shape(), sl.get_dtype()
            elem = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}[size]
            n = 1
            for d in shape:
                n *= d
            own_head = "lm_head.weight" in names or "lm_head.qweight" in names
            total += elem * (shape[-1] if "embed_tokens" in name and own_head else n)
    return total + ctx_bytes


def decode_rounds(decoders: dict, bytes_per_tok, repeats: int) -> dict:
    """Batch-1 decode of every engine, interleaved: each round runs every engine once, so all engines see
    the same phases of this shared VM (its bandwidth drifts by tens of percent within minutes, sometimes
    within seconds). The copy bandwidth is measured before the round and after each run; the round's
    roofline uses the median of those, for every engine alike; `bytes_per_tok` is one number for all engines
    or a dict by engine. (Per-run brackets were tried: a single copy
    measurement also catches what the neighbouring run leaves behind, and in one full run the Engine and the
    pool decoded at the same speed in the same rounds yet came out 0.78 and 0.85 of "their" rooflines.)
    Per engine: medians over rounds of tokens/s, of the roofline ratio and of the bandwidth, and
    `decode_b1_vs_allspark`, the median over rounds of its tokens/s over the Engine's in the same round;
    `decode_b1_tps_by_round`: every engine's tokens/s per round, for any other pairing (`same_round_ratio`).
    Round r starts with the r-th engine (the order rotates), so no engine always runs first or last."""
    runs = {name: [] for name in decoders}
    order = list(decoders)
    for r in range(repeats):
        bws, tps = [machine.copy_bandwidth()], {}
        for name in order[r % len(order):] + order[:r % len(order)]:
            tps[name] = decoders[name](r)
            bws.append(machine.copy_bandwidth())
        bw = statistics.median(bws)
        for name, t in tps.items():
            nbytes = bytes_per_tok[name] if isinstance(bytes_per_tok, dict) else bytes_per_tok
            runs[name].append((t, t * nbytes / (bw * 1e9), bw))
    out = {}
    for name, rs in runs.items():
        out[name] = {"decode_b1_tps": statistics.median(x[0] for x in rs),
                     "decode_b1_roofline": statistics.median(x[1] for x in rs),
                     "copy_gbs_at_decode": statistics.median(x[2] for x in rs)}
        if name != "allspark":
            out[name]["decode_b1_vs_allspark"] = statistics.median(
                x[0] / ours[0] for x, ours in zip(rs, runs["allspark"]))
    out["decode_b1_tps_by_round"] = {name: [x[0] for x in rs] for name, rs in runs.items()}
    return out


def ttft_rounds(engine, models: dict, vocab: int, spec: dict) -> dict:
    """TTFT of the same Engine's models ({key: model name}, "allspark" the unquantized one), interleaved like
    `decode_rounds`: round r gives every model the same prompt, new to all of them (no prefix-cache hits, also
    not on the Engine's own TTFT prompts of `engine_workloads`), starting with the r-th model. Per model and
    prompt length: the median TTFT and, for the others, `ttft_<p>_vs_allspark`, the median of same-round ratios
    (> 1: slower than the unquantized model)."""
    order = list(models)
    out = {key: {} for key in models}
    for p in spec["prompts"]:
        runs = {key: [] for key in models}
        for r in range(spec["repeats"]):
            ids = W.ttft_prompt(p, r, vocab, salt=1)
            for key in order[r % len(order):] + order[:r % len(order)]:
                runs[key].append(W.first_token_s(engine, models[key], ids))
        for key, ts in runs.items():
            out[key][f"ttft_{p}_s"] = statistics.median(ts)
            if key != "allspark":
                out[key][f"ttft_{p}_vs_allspark"] = statistics.median(a / b for a, b in zip(ts, runs["allspark"]))
    return out


def same_round_ratio(by_round: dict, ours: str, theirs: str) -> float:
    """Median over rounds of `ours` tokens/s over `theirs` in the same round (> 1: ours is faster)."""
    return statistics.median(a / b for a, b in zip(by_round[ours], by_round[theirs]))


def engine_workloads(engine, name: str, spec: dict) -> dict:
    """TTFT, concurrent throughput and Poisson arrivals through the Engine API."""
    vocab, n = spec["vocab"], spec["new_tokens"]
    out = {}
    for p in spec["prompts"]:
        out[f"ttft_{p}_s"] = W.ttft(engine, name, vocab, p, spec["repeats"])
    for c in spec["concurrency"]:
        out[f"c{c}_tps"] = W.concurrent_tps(engine, name, vocab, c, 128, n)
    top = max(spec["concurrency"])
    rate = 0.5 * out[f"c{top}_tps"] / n                     # half the measured capacity, in requests/s
    out["poisson_rate_rps"] = rate
    out.update({f"poisson_{k}": v for k, v in W.poisson(engine, name, vocab, spec["poisson_n"], rate, 128, n).items()})
    return out


def hf_workloads(hf_model, spec: dict) -> dict:
    vocab, n = spec["vocab"], spec["new_tokens"]
    out = {}
    for p in spec["prompts"]:
        out[f"ttft_{p}_s"] = W.hf_ttft(hf_model, vocab, p, spec["repeats"])
    for c in spec["concurrency"]:
        out[f"c{c}_tps"] = W.hf_concurrent_tps(hf_model, vocab, c, 128, n)
    return out


def runtime_cfg(loader, name: str, spec: dict, max_batch: int):
    return (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=max_batch)
            .max_length(max(spec["prompts"]) + spec["new_tokens"] + 8).kv_cache_span_size(32).build())


def llamacpp_pairs(dtype: str, quant: list[str]) -> list[tuple[str, str]]:
    """(our engine key, the llama.cpp peer that races it on the same weights). bf16 weights race both f16
    (llama.cpp's usual dense type) and bf16 (the very same bytes; its AVX-512 bf16 path where there is one)."""
    dense = {"float32": ["f32"], "bfloat16": ["f16", "bf16"]}.get(dtype, ["f16"])
    return ([("allspark", f"llamacpp_{t}") for t in dense]
            + [(f"allspark_{v}", f"llamacpp_{LP.peer_type(v)}") for v in quant])


def run_dtype(dtype: str, spec: dict, threads: int, with_pool: bool, decode_only: bool, quant: list[str],
              ttft_rows: bool = False, with_hf: bool = True, llamacpp: bool = False,
              llamacpp_check: bool = False, kv_modes: list[str] = (), kv_weights: Optional[str] = None) -> dict:
    """All engines are loaded at once (so their decode runs can interleave); then the other
    workloads run one engine after the other."""
    from transformers import AutoModelForCausalLM
    from allspark_client import ClientEngine
    from allspark_server import Engine, HuggingFaceModel
    hf_dir = build_model(spec, dtype)
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    loader = HuggingFaceModel(hf_dir, f"bench-{dtype}", user_set_data_type=dtype)
    loader.load_model().serialize_to_path(None, hf_dir, skip_if_exists=False).free_model()
    name, vocab, n = loader.model_name, spec["vocab"], spec["new_tokens"]
    cfg = runtime_cfg(loader, name, spec, max(spec["concurrency"]))
    bpt = bytes_per_token(hf, spec, ctx=W.DECODE_PROMPT_LEN + n // 2)
    result = {"params_m": sum(p.numel() for p in hf.parameters()) / 1e6, "bytes_per_token": bpt}
    quant_cfgs = {}
    for variant in quant:                     # the same weights, quantized, served by the same Engine
        q = HuggingFaceModel(hf_dir, f"{name}-{variant}", user_set_data_type=dtype)
        q.load_model().serialize_to_path(None, os.path.join(hf_dir, "quant"), enable_quant=True,
                                         customized_quant_config=quant_variant(variant)).free_model()
        quant_cfgs[f"allspark_{variant}"] = (q, runtime_cfg(q, q.model_name, spec, max(spec["concurrency"])))
    pairs = llamacpp_pairs(dtype, quant) if llamacpp else []
    ggufs = {peer: LP.gguf_file(hf_dir, peer.removeprefix("llamacpp_")) for _, peer in pairs}
    if llamacpp_check:
        result["llamacpp_check"] = LP.check_against_transformers(hf_dir, ggufs, threads)

    with contextlib.ExitStack() as stack:
        engines = {"allspark": Engine()}
        stack.callback(engines["allspark"].shutdown)
        if with_pool:
            engines["pool_2_ranks"] = stack.enter_context(ClientEngine(ranks=2))
        for engine in engines.values():
            engine.install_model(cfg)
            engine.start_model(name)
        ours = engines["allspark"]
        for q, qcfg in quant_cfgs.values():
            ours.install_model(qcfg)
            ours.start_model(q.model_name)
        decoders = {key: (lambda r, e=engine: W.decode_tps(e, name, vocab, n, seed=r))
                    for key, engine in engines.items()}
        for key, (q, _) in quant_cfgs.items():
            decoders[key] = lambda r, qn=q.model_name: W.decode_tps(ours, qn, vocab, n, seed=r)
        if with_hf:
            decoders["transformers"] = lambda r, hf=hf: W.hf_decode_tps(hf, vocab, n, seed=r)
        for key, path in ggufs.items():
            llm = LP.load(path, threads, n_ctx=W.DECODE_PROMPT_LEN + n + 8)
            stack.callback(llm.close)
            decoders[key] = lambda r, llm=llm: LP.decode_tps(llm, vocab, n, seed=r)
        for decode_once in decoders.values():
            decode_once(99)                                                         # warm-up
        kv = bpt - file_bytes_per_token(loader.weights_path, 0)                     # the KV cache's share
        per_engine = {key: bpt for key in decoders}
        per_engine.update({key: file_bytes_per_token(q.weights_path, kv) for key, (q, _) in quant_cfgs.items()})
        gguf_sizes = {key: LP.gguf_bytes_per_token(path, LP.kv_bytes_f16(hf_dir, W.DECODE_PROMPT_LEN + n // 2))
                      for key, path in ggufs.items()}
        per_engine.update({key: sizes["bytes_per_token"] for key, sizes in gguf_sizes.items()})
        result.update(decode_rounds(decoders, per_engine, spec["decode_repeats"]))
        for key in quant_cfgs:
            result[key]["bytes_per_token"] = per_engine[key]
        for key, sizes in gguf_sizes.items():
            result[key].update(sizes)
        if pairs:
            result["vs_llamacpp"] = {f"{ours}/{theirs}": same_round_ratio(result["decode_b1_tps_by_round"], ours, theirs)
                                     for ours, theirs in pairs}
        if not decode_only:
            for key, engine in engines.items():
                result[key].update(engine_workloads(engine, name, spec))
            if with_hf:
                result["transformers"].update(hf_workloads(hf, spec))
        if kv_modes:
            result["kv_modes"] = kv_mode_rounds(ours, loader, hf, spec, kv_modes, spec["kv_context"])
            if kv_weights:   # the same rows on quantized weights: the KV cache is then a larger share of the bytes
                q = quant_cfgs[f"allspark_{kv_weights}"][0]
                result[f"kv_modes_{kv_weights}"] = kv_mode_rounds(ours, q, hf, spec, kv_modes, spec["kv_context"],
                                                                  file_bytes_per_token(q.weights_path, 0))
        # without --decode-only engine_workloads has the Engine's own TTFT; the rounds then add the quantized models'
        if ttft_rows if decode_only else quant_cfgs:
            models = {"allspark": name, **{key: q.model_name for key, (q, _) in quant_cfgs.items()}}
            for key, row in ttft_rounds(ours, models, vocab, spec).items():
                if decode_only or key != "allspark":
                    result[key].update(row)
        for q, _ in quant_cfgs.values():
            ours.stop_model(q.model_name)
            ours.release_model(q.model_name)
        for engine in engines.values():
            if engine.stop_model(name) == 0:
                engine.release_model(name)
    del hf
    return result


def kv_mode_rounds(engine, loader, hf, spec: dict, modes: list[str], context: int,
                   weights: Optional[int] = None) -> dict:
    """Batch-1 decode after a `context`-token prompt with the unquantized KV cache ("allspark") and with each
    quantized KV mode (`allspark_kv_<mode>`), the same weights (`loader`'s: the dense model, or a quantized one,
    whose bytes a token reads are then `weights`) in the same Engine, interleaved like decode_rounds; each roofline
    counts its own KV bytes."""
    from allspark_server.quant.kv import bytes_per_row
    vocab, n = spec["vocab"], spec["new_tokens"]
    head_dim = spec["hidden_size"] // spec["num_heads"]
    ctx = context + n // 2
    weights = bytes_per_token(hf, spec, 0) if weights is None else weights
    decoders, per_engine, names = {}, {}, []
    for mode in ["default"] + modes:
        key = "allspark" if mode == "default" else f"allspark_kv_{mode}"
        name = f"{loader.model_name}-kv-{mode}"
        cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=1)
               .model_file_path(loader.graph_path, loader.weights_path).max_length(context + n + 8)
               .kv_cache_span_size(32).kv_cache_mode(mode).build())
        engine.install_model(cfg)
        engine.start_model(name)
        names.append(name)
        decoders[key] = lambda r, nm=name: W.decode_tps(engine, nm, vocab, n, seed=r, prompt_len=context)
        per_engine[key] = weights + 2 * spec["num_layers"] * ctx * spec["num_kv_heads"] * bytes_per_row(
            None if mode == "default" else mode, head_dim, hf.dtype)
    for decode_once in decoders.values():
        decode_once(99)
    out = decode_rounds(decoders, per_engine, spec["decode_repeats"])
    for key in decoders:
        out[key]["bytes_per_token"] = per_engine[key]
    for name in names:
        engine.stop_model(name)
        engine.release_model(name)
    return {"context": context, "weights": loader.model_name, **out}


def summarize(report: dict) -> list[str]:
    lines = []
    bw = report["machine"]["copy_gbs"]
    lines.append(f"machine: {report['machine']['cpu']}, {report['threads']} threads, copy {bw:.1f} GB/s, "
                 f"triad {report['machine']['triad_gbs']:.1f} GB/s, matmul fp32 {report['machine']['matmul_fp32_gflops']:.0f}"
                 f" / bf16 {report['machine']['matmul_bf16_gflops']:.0f} GFLOP/s")
    for dtype, r in report["dtypes"].items():
        roof = bw * 1e9 / r["bytes_per_token"]
        lines.append(f"\n{dtype}: {r['params_m']:.0f} M parameters, {r['bytes_per_token'] / 1e6:.0f} MB read per token, "
                     f"roofline {roof:.1f} tokens/s at the start's copy bandwidth")
        engines = [e for e in r if isinstance(r[e], dict) and "decode_b1_tps" in r[e]]
        keys = [k for k in r["allspark"] if not k.startswith("poisson_rate")]
        hf = r.get("transformers")
        lines.append(f"{'metric':<22}" + "".join(f"{e:>18}" for e in engines))
        for k in keys:
            lines.append(f"{k:<22}" + "".join(f"{r[e][k]:>18.3f}" if k in r[e] else f"{'-':>18}" for e in engines))
        ours = r["allspark"]
        lines.append(f"batch-1 decode / roofline (bandwidth measured around each round): "
                     f"{ours['decode_b1_roofline']:.2f}" + ("" if hf is None else
                     f"; vs transformers: batch 1 {1 / hf['decode_b1_vs_allspark']:.2f}x (same rounds)" +
                     "".join(f", {c} concurrent {ours[f'c{c}_tps'] / hf[f'c{c}_tps']:.2f}x"
                             for c in report["spec"]["concurrency"] if f"c{c}_tps" in ours)))
        if "pool_2_ranks" in r:
            lines.append(f"2-rank pool batch-1 decode / single Engine (same rounds): "
                         f"{r['pool_2_ranks']['decode_b1_vs_allspark']:.2f}")
        for e in engines:
            if e.startswith("allspark_"):
                ttft = "".join(f", TTFT-{p} {r[e][f'ttft_{p}_vs_allspark']:.2f}x"
                               for p in report["spec"]["prompts"] if f"ttft_{p}_vs_allspark" in r[e])
                lines.append(f"{e}: batch-1 decode {r[e]['decode_b1_vs_allspark']:.2f}x of {dtype} (same rounds), "
                             f"{r[e]['decode_b1_roofline']:.2f} of its roofline ({r[e]['bytes_per_token'] / 1e6:.0f} MB "
                             f"per token){ttft}")
        for pair, ratio in r.get("vs_llamacpp", {}).items():
            theirs = r[pair.split("/")[1]]
            lines.append(f"{pair}: {ratio:.2f}x batch-1 decode (ours / theirs, same rounds; llama.cpp "
                         f"{theirs['decode_b1_roofline']:.2f} of its roofline, {theirs['bytes_per_token'] / 1e6:.0f} MB "
                         f"per token, file {theirs['gguf_bytes'] / 1e6:.0f} MB)")
        for key, c in r.get("llamacpp_check", {}).items():
            lines.append(f"{key} logits vs transformers fp32: top-1 agree {c['top1_agree']:.2f}, relative L2 error "
                         f"{c['rel_l2_err']:.2e}, min cosine {c['min_cosine']:.5f}, max |err| {c['max_abs_err_in_std']:.3f} std")
        for rows in (key for key in r if key.startswith("kv_modes")):
            kv = r[rows]
            weights = rows.removeprefix("kv_modes").removeprefix("_") or dtype
            lines.append(f"decode after a {kv['context']}-token prompt, {weights} weights: unquantized KV "
                         f"{kv['allspark']['decode_b1_tps']:.1f} tok/s" +
                         "".join(f", {e.removeprefix('allspark_')} {kv[e]['decode_b1_vs_allspark']:.2f}x"
                                 for e in kv if e.startswith("allspark_")) + " (same rounds)")
    return lines


def write_report(path: str, report: dict) -> None:
    """A benchmark's report as JSON at `path` (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def machine_name() -> str:
    try:
        import cpuinfo
        return cpuinfo.get_cpu_info().get("brand_raw", platform.processor())
    except Exception:
        return platform.processor()


def measure_name(a) -> str:
    """The measure a run's flags make, the first part of its default result file's name."""
    if a.device == "cuda":
        return "cuda"
    return "features" if a.features else "quant" if a.quant else "kv" if a.kv else "engines"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model and fewer runs (< 3 minutes)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--no-pool", action="store_true", help="skip the 2-rank pool")
    p.add_argument("--decode-only", action="store_true", help="only the batch-1 decode rows (kernel work)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (kernel work on our own engines)")
    p.add_argument("--ttft", action="store_true", help="with --decode-only: also the Engine's TTFT rows")
    p.add_argument("--quant", nargs="*", default=[], metavar="FORMAT[_gGROUP]",
                   help="also serve the weights quantized, e.g. int8 int4_g32 uint4_g64 int8+head int8+a8 (InstantQuant)")
    p.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=None,
                   help="race llama.cpp (llama-cpp-python) on the same weights as GGUF; default: when importable")
    p.add_argument("--llamacpp-check", action="store_true",
                   help="also compare llama.cpp's logits on the GGUF files with transformers' (fp32)")
    p.add_argument("--kv", nargs="*", default=[], choices=["int8", "uint4"],
                   help="also decode after a long prompt (2048 tokens; --quick 512) with quantized KV spans, "
                        "interleaved with the unquantized cache")
    p.add_argument("--kv-weights", default=None, metavar="VARIANT",
                   help="with --kv: the same rows also on one of the --quant variants (e.g. int4_g64+a8+head)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the GPU benchmark instead (cuda_bench.py: one GPU, a Llama-2-7B-shaped bf16 model)")
    p.add_argument("--features", action="store_true",
                   help="the serving features instead: prefix cache and guided JSON (serving_features.py)")
    p.add_argument("--sections", nargs="+", default=None, help="which sections: with --features guided prefix "
                   "pool mbu; with --device cuda the rows after batch 1, ttft pool concurrency poisson")
    p.add_argument("--ttft-repeats", type=int, default=None,
                   help="prompts per TTFT length (default 5, --quick 2): more rounds for the interleaved TTFT ratios")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved batch-1 decode rounds (default 7; --quick 3)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/<measure>-<machine>.json, the measure "
                   "cuda, features, quant, kv or engines (by the flags); --quick: under results/quick/")
    a = p.parse_args()
    if a.kv_weights and (a.kv_weights not in a.quant or not a.kv):
        p.error(f"--kv-weights {a.kv_weights} needs --kv and the same variant in --quant (--quant: {a.quant})")
    a.json = a.json or common.result_path(measure_name(a), a.device, a.quick)
    if a.device == "cuda":
        import cuda_bench
        save = functools.partial(write_report, a.json)
        report = cuda_bench.main(a, save)
        save(report)
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}, indent=1))
        return
    spec = QUICK if a.quick else FULL
    if a.rounds:
        spec = dict(spec, decode_repeats=a.rounds)
    if a.ttft_repeats:
        spec = dict(spec, repeats=a.ttft_repeats)
    if a.features:
        import serving_features

        def save(report):
            report["machine"] = machine_name()
            write_report(a.json, report)
        torch.set_num_threads(a.threads)
        earlier = None
        if a.sections and os.path.exists(a.json):   # keep the sections not run now
            with open(a.json) as f:
                earlier = json.load(f)
        save(serving_features.main(spec, build_model, save, a.sections or serving_features.SECTIONS, earlier))
        return
    why_not = LP.missing() if a.llamacpp is not False else None
    if why_not:
        print(why_not)
    a.llamacpp = a.llamacpp is not False and why_not is None
    torch.set_num_threads(a.threads)
    t0 = time.time()
    cpu = machine_name()
    report = {"spec": spec, "threads": a.threads, "quick": a.quick, "decode_only": a.decode_only,
              "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
              "machine": dict(cpu=cpu, **machine.stream_bandwidth(),
                              matmul_fp32_gflops=machine.matmul_gflops(torch.float32),
                              matmul_bf16_gflops=machine.matmul_gflops(torch.bfloat16)),
              "dtypes": {}}
    if a.llamacpp:
        import gguf
        import llama_cpp
        report["llamacpp"] = {"llama_cpp_python": llama_cpp.__version__, "flash_attn": LP.FLASH_ATTN,
                              "gguf": getattr(gguf, "__version__", None),
                              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    for dtype in a.dtypes:
        report["dtypes"][dtype] = run_dtype(dtype, spec, a.threads, not a.no_pool, a.decode_only, a.quant,
                                            a.ttft, not a.no_hf, a.llamacpp, a.llamacpp and a.llamacpp_check,
                                            a.kv, a.kv_weights)
    report["wall_s"] = time.time() - t0
    print("\n".join(summarize(report)))
    print(f"\n({report['wall_s']:.0f} s)")
    write_report(a.json, report)


if __name__ == "__main__":
    main()
