"""The CPU harness's method: engines measured round by round on a shared machine, ratios taken within a round.

decode_rounds interleaves every engine's batch-1 decode with the copy bandwidth measured around each run;
ttft_rounds does the same for time to first token; kv_mode_rounds decodes after a long prompt on quantized KV spans
against the unquantized cache. What they run is the caller's (cpu_bench.py, moe.py); this module only orders,
times and takes medians.
"""
from __future__ import annotations

import statistics
from typing import Optional

import common
import machine
import workloads as W


def decode_rounds(decoders: dict, bytes_per_tok, repeats: int) -> dict:
    """Batch-1 decode of every engine, interleaved: each round runs every engine once, so all engines see
    the same phases of this shared VM (its bandwidth drifts by tens of percent within minutes, sometimes
    within seconds). The copy bandwidth is measured before the round and after each run; the round's
    roofline uses the median of those, for every engine alike; `bytes_per_tok` is one number for all engines
    or a dict by engine. (Not a bracket per run: a single copy measurement also catches what the neighbouring
    run leaves behind, so two engines decoding at the same speed in one round could come out at different
    fractions of "their" rooflines.)
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
    weights = common.bytes_per_token(hf, spec, 0) if weights is None else weights
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

