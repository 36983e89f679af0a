"""The CPU benchmark of run.py for one weight dtype: our Engine, a 2-rank pool, transformers, the quantized
variants and llama.cpp's GGUF peers on the same weights, all loaded at once so their batch-1 decodes interleave;
then TTFT, concurrency and Poisson rows one engine after the other; and the printed summary of a report.

run.py owns the command line and the report's frame; cpu_rounds.py the interleaving.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import common
import llamacpp_peer as LP
import torch
import workloads as W
from cpu_rounds import decode_rounds, kv_mode_rounds, same_round_ratio, ttft_rounds


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
    hf_dir = common.build_model(spec, dtype)
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    loader = HuggingFaceModel(hf_dir, f"bench-{dtype}", user_set_data_type=dtype)
    loader.load_model().serialize_to_path(None, hf_dir, skip_if_exists=False).free_model()
    name, vocab, n = loader.model_name, spec["vocab"], spec["new_tokens"]
    cfg = common.runtime_cfg(loader, name, spec, max(spec["concurrency"]))
    bpt = common.bytes_per_token(hf, spec, ctx=W.DECODE_PROMPT_LEN + n // 2)
    result = {"params_m": sum(p.numel() for p in hf.parameters()) / 1e6, "bytes_per_token": bpt}
    quant_cfgs = {}
    for variant in quant:                     # the same weights, quantized, served by the same Engine
        q = HuggingFaceModel(hf_dir, f"{name}-{variant}", user_set_data_type=dtype)
        q.load_model().serialize_to_path(None, os.path.join(hf_dir, "quant"), enable_quant=True,
                                         customized_quant_config=common.quant_variant(variant)).free_model()
        qcfg = common.runtime_cfg(q, q.model_name, spec, max(spec["concurrency"]))
        quant_cfgs[f"allspark_{variant}"] = (q, qcfg)
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
        kv = bpt - common.file_bytes_per_token(loader.weights_path, 0)                     # the KV cache's share
        per_engine = {key: bpt for key in decoders}
        per_engine.update({key: common.file_bytes_per_token(q.weights_path, kv)
                           for key, (q, _) in quant_cfgs.items()})
        gguf_sizes = {key: LP.gguf_bytes_per_token(path, LP.kv_bytes_f16(hf_dir, W.DECODE_PROMPT_LEN + n // 2))
                      for key, path in ggufs.items()}
        per_engine.update({key: sizes["bytes_per_token"] for key, sizes in gguf_sizes.items()})
        result.update(decode_rounds(decoders, per_engine, spec["decode_repeats"]))
        for key in quant_cfgs:
            result[key]["bytes_per_token"] = per_engine[key]
        for key, sizes in gguf_sizes.items():
            result[key].update(sizes)
        if pairs:
            result["vs_llamacpp"] = {f"{ours}/{theirs}": same_round_ratio(result["decode_b1_tps_by_round"],
                                                                           ours, theirs)
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
                                                                  common.file_bytes_per_token(q.weights_path, 0))
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


def summarize(report: dict) -> list[str]:
    lines = []
    bw = report["machine"]["copy_gbs"]
    lines.append(f"machine: {report['machine']['cpu']}, {report['threads']} threads, copy {bw:.1f} GB/s, "
                 f"triad {report['machine']['triad_gbs']:.1f} GB/s, "
                 f"matmul fp32 {report['machine']['matmul_fp32_gflops']:.0f}"
                 f" / bf16 {report['machine']['matmul_bf16_gflops']:.0f} GFLOP/s")
    for dtype, r in report["dtypes"].items():
        roof = bw * 1e9 / r["bytes_per_token"]
        lines.append(f"\n{dtype}: {r['params_m']:.0f} M parameters, {r['bytes_per_token'] / 1e6:.0f} MB read per "
                     f"token, roofline {roof:.1f} tokens/s at the start's copy bandwidth")
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
                             f"{r[e]['decode_b1_roofline']:.2f} of its roofline ({r[e]['bytes_per_token'] / 1e6:.0f} "
                             f"MB per token){ttft}")
        for pair, ratio in r.get("vs_llamacpp", {}).items():
            theirs = r[pair.split("/")[1]]
            lines.append(f"{pair}: {ratio:.2f}x batch-1 decode (ours / theirs, same rounds; llama.cpp "
                         f"{theirs['decode_b1_roofline']:.2f} of its roofline, {theirs['bytes_per_token'] / 1e6:.0f} "
                         f"MB per token, file {theirs['gguf_bytes'] / 1e6:.0f} MB)")
        for key, c in r.get("llamacpp_check", {}).items():
            lines.append(f"{key} logits vs transformers fp32: top-1 agree {c['top1_agree']:.2f}, relative L2 error "
                         f"{c['rel_l2_err']:.2e}, min cosine {c['min_cosine']:.5f}, "
                         f"max |err| {c['max_abs_err_in_std']:.3f} std")
        for rows in (key for key in r if key.startswith("kv_modes")):
            kv = r[rows]
            weights = rows.removeprefix("kv_modes").removeprefix("_") or dtype
            lines.append(f"decode after a {kv['context']}-token prompt, {weights} weights: unquantized KV "
                         f"{kv['allspark']['decode_b1_tps']:.1f} tok/s" +
                         "".join(f", {e.removeprefix('allspark_')} {kv[e]['decode_b1_vs_allspark']:.2f}x"
                                 for e in kv if e.startswith("allspark_")) + " (same rounds)")
    return lines

