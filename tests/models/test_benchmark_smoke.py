"""Every script in benchmarks/ runs in CI, once, so that none rots unseen, on tiny shapes: its `--smoke` flag
(common.SMOKE: a 2-layer model and one round of everything) or the smallest arguments it takes; numbers are checked
for sanity only, timings never. This file: the harness and the GPU scripts; the CPU micro-benchmarks, the Engine's
scripts, llama.cpp and 2-host pools: test_benchmark_scripts.py (both through tests/bench_helpers.py).

- The harness, run.py, also runs as a user runs it (a subprocess): our Engine against transformers, and llama.cpp on
  the same weights (an f32 GGUF, its logits checked against transformers') when llama-cpp-python is installed.
- GPU scripts: the Triton kernel micro-benchmarks run without a GPU in Triton's interpreter on CPU tensors; the rest
  import and parse their arguments here, and what of them runs on a CPU does (the peer decode step against
  transformers, the step profile, the A/B switch of overlapped scheduling); the `gpu` tests run them on a GPU.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from bench_helpers import BENCH, needs_gpu, positive, read
from pool_helpers import REPO, repo_env


def test_benchmark_decode_only_runs(tmp_path):
    out = tmp_path / "results.json"
    env = dict(repo_env(), HOME=str(tmp_path))          # the benchmark model is built under ~/.cache
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--smoke", "--decode-only", "--no-pool",
                           "--dtypes", "float32", "--llamacpp-check", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "batch-1 decode / roofline" in proc.stdout
    report = json.loads(out.read_text())
    assert report["decode_only"] and report["spec"]["num_layers"] == 2
    r = report["dtypes"]["float32"]
    assert os.path.isdir(tmp_path / ".cache" / "allspark" / "bench")
    # bytes per token: every weight once (embedding: one row) + the KV cache, from the model's own parameters
    assert r["bytes_per_token"] > 4 * r["params_m"] * 1e6 * 0.5
    for engine in ("allspark", "transformers"):
        row = r[engine]
        extra = {"decode_b1_vs_allspark"} if engine == "transformers" else set()   # per-round ratio, interleaved
        assert set(row) == {"decode_b1_tps", "decode_b1_roofline", "copy_gbs_at_decode"} | extra
        assert all(math.isfinite(v) and v > 0 for v in row.values()), row
        # a fraction of the bandwidth bound; well above 1 would mean bytes per token or bandwidth is miscounted
        assert row["decode_b1_roofline"] < 2.0
    if "llamacpp_f32" in r:                                # the optional peer ran: same weights, same rounds
        row = r["llamacpp_f32"]
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("decode_b1_tps", "decode_b1_vs_allspark"))
        assert row["decode_b1_roofline"] < 2.0
        assert r["vs_llamacpp"]["allspark/llamacpp_f32"] > 0
        check = r["llamacpp_check"]["llamacpp_f32"]             # the GGUF conversion is right
        assert check["rel_l2_err"] < 1e-2 and check["top1_agree"] > 0.9, check


def test_run_every_row_quantized_weights_and_kv(bench, tmp_path):
    """run.py's other rows on the tiny model: TTFT, concurrency and Poisson arrivals for the Engine and transformers,
    the quantized weights' decode and TTFT rounds, the quantized KV rows on dense and quantized weights. (A 2-rank
    pool runs the same workloads through ClientEngine: the features' pool section below.)"""
    out = tmp_path / "engines.json"
    bench("run", "--smoke", "--dtypes", "bfloat16", "--quant", "int8", "--kv", "int8", "--kv-weights", "int8",
          "--no-pool", "--no-llamacpp", "--json", out)
    r = read(out)["dtypes"]["bfloat16"]
    for engine in ("allspark", "transformers"):
        assert positive(r[engine]["decode_b1_tps"], r[engine]["ttft_16_s"], r[engine]["c2_tps"]), r[engine]
    assert positive(r["allspark"]["poisson_ttft_median"], r["allspark_int8"]["ttft_128_vs_allspark"])
    assert positive(r["kv_modes"]["allspark_kv_int8"]["decode_b1_vs_allspark"])
    assert positive(r["kv_modes_int8"]["allspark_kv_int8"]["decode_b1_vs_allspark"])


def test_run_serving_features(bench, tmp_path):
    """run.py --features (serving_features.py) on its tiny sizes: the prefix cache, guided JSON (parsed against its
    schema by the section itself), a 2-rank pool's rows and the engine's MBU next to the benchmark's roofline."""
    out = tmp_path / "features.json"
    bench("run", "--smoke", "--features", "--json", out)
    r = read(out)
    assert r["prefix_cache"]["shared_prefix"]["second_prefix_cache_len"][0] > 0
    assert positive(r["prefix_cache"]["multi_turn_concurrent"]["total_speedup"])
    assert positive(r["guided_json"]["c2"]["guided_tpot_ms"], r["pool_2_ranks"]["guided_c1"]["ratio"])
    assert positive(r["mbu"]["engine_vs_benchmark"])


def test_one_loop_reader_times_every_token(served_llama):
    """The concurrency rows' asyncio reader (workloads.token_times_one_loop, the HTTP server's QueueReader) sees
    each request's every token once, in order: as many arrival times as tokens, never decreasing; and it
    releases every request it started."""
    sys.path.insert(0, BENCH)
    import workloads as W
    engine, _ = served_llama
    started, released = [], []

    class Recording:     # the engine, noting which requests are started and released
        def start_request(self, *args):
            out = engine.start_request(*args)
            started.append(out[1])
            return out

        def release_request(self, name, handle):
            released.append(handle)
            return engine.release_request(name, handle)

        def get_last_error(self):
            return engine.get_last_error()
    prompts = [W.prompt(5 + i, 900 + i, 100) for i in range(6)]      # more than one step's admissions
    stamps = W.token_times_one_loop(Recording(), "llama", prompts, 7)
    assert [len(s) for s in stamps] == [7] * len(prompts)
    assert all(s == sorted(s) for s in stamps)
    assert len(started) == len(prompts) and released == started
    assert not any(engine.has_request("llama", h) for h in started)


def test_run_device_cuda_parses_and_imports(bench, capsys):
    """`run.py --device cuda`'s modules import and its parser builds without a GPU (the run is the gpu test)."""
    for module in ("cuda_bench", "cuda_rows", "cuda_common", "torch_cuda_peer", "step_profile"):
        importlib.import_module(module)
    with pytest.raises(SystemExit) as done:
        bench("run", "--help")
    assert done.value.code == 0 and "--device" in capsys.readouterr().out


def test_cuda_helpers_on_a_cpu_engine(bench, served_llama, llama):
    """What of the GPU benchmark runs on a CPU: overlap_off swaps a served model's step loop for one step at a time
    and back (what `_overlap` was before engine/step_loops.py); StepProfile times a decode's steps; the PyTorch
    peer's decode step matches transformers."""
    import cuda_common as CC
    import step_profile
    import torch_cuda_peer
    import workloads as W

    from allspark_server.engine.step_loops import OverlappedLoop, SerialLoop
    engine, loader = served_llama
    name = loader.model_name
    served = engine._models[name]
    original = served.loop
    served.loop = OverlappedLoop()          # as a GPU model's; nothing is in flight between requests
    try:
        with CC.overlap_off(served):
            assert isinstance(served.loop, SerialLoop)
            profile = step_profile.StepProfile(served)
            assert len(W.greedy_tokens(engine, name, [5, 6, 7], 6)) == 6
            profile.restore()
        assert isinstance(served.loop, OverlappedLoop)
    finally:
        served.loop = original
    steps = profile.summary()
    assert steps["decode b1"]["steps"] >= 4 and positive(steps["decode b1"]["wall_ms"]), steps
    assert torch_cuda_peer.check_against_hf(llama.model, [5, 6, 7, 8, 9]) < 1e-4


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("argv", [
    ["run.py", "--device", "cuda", "--smoke", "--quant", "int8"],
    ["gpu_ttft_profile.py", "--device", "cuda", "--cases", "tiny-bf16", "--prompt", "64", "--repeats", "1", "--graph"],
    ["ab_trees.py", "--old", ".", "--device", "cuda", "--smoke", "--variants", "bf16", "--turns", "1", "--tokens", "4"],
], ids=lambda argv: argv[0])
def test_gpu_scripts_run(argv, tmp_path):
    env = dict(repo_env(), HOME=str(tmp_path), OUT=str(tmp_path))
    if argv[0] == "run.py":
        argv = argv + ["--json", str(tmp_path / "cuda.json")]
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", argv[0]), *argv[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_allreduce_micro_runs(bench, tmp_path):
    out = tmp_path / "allreduce.json"
    bench("allreduce_micro", "--rows", "1", "--calls", "2", "--json", out)
    row = read(out)["rows"]["1"]
    errors = {k: v for k, v in row.items() if k.endswith("_err")}     # bf16 sums against the exact one
    assert "nccl_err" in errors and all(v < 0.1 for v in errors.values()), row


def test_two_gpu_scripts_refuse_clearly(bench, capsys):
    """allreduce_micro.py refuses one GPU; pool_step_micro.py (run.py --device cuda's pool rows start it under mpirun
    on two GPUs) parses its arguments."""
    with pytest.raises(SystemExit) as done:
        bench("pool_step_micro", "--help")
    assert done.value.code == 0 and "--batch" in capsys.readouterr().out
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit, match="needs 2 GPUs"):
            bench("allreduce_micro")


# ---- the Triton kernels' micro-benchmarks (without a GPU: Triton's interpreter) -----------------------------------
def test_cuda_gemv_micro(bench, tmp_path):
    out = tmp_path / "gemv.json"
    bench("cuda_gemv_micro", "--smoke", "--sweep", "--out", out)
    r = read(out)
    for rows in r["rows"].values():
        assert all(row["triton_rel_err"] < 2e-2 and positive(row["triton_us"]) for row in rows.values()), rows
    assert all(sweep["best"] and not sweep["errors"] for sweep in r["sweep"].values()), r["sweep"]
    bench("cuda_gemv_micro", "--smoke", "--lora-sweep", "--out", out)
    tiles = {name: s["tiles"] for name, s in read(out)["lora_sweep"].items()}
    assert tiles.keys() == {"o", "gate_up"} and all(len(t) == 2 for t in tiles.values()), tiles
    assert all(positive(t["plain_us"]) and positive(t["lora_us"]) for t in tiles["o"] + tiles["gate_up"]), tiles
    assert all(positive(t["silu_mul_us"]) for t in tiles["gate_up"]) and "silu_mul_us" not in tiles["o"][0], tiles


def test_exact_rows_micro(bench, tmp_path):
    """The invariant-rows race runs; its FMA rows are near float64 and every kernel's 2 rows equal each row alone (the
    tensor-core rows' sums are not checked here: the interpreter's 16-bit tl.dot is wrong, the GPU run checks them).
    Two rows: the fewest that can differ from themselves alone, and the most that still take the one-row GEMV's
    path too (every row alone is a launch of its own: the interpreter's time goes by the rows)."""
    out = tmp_path / "exact.json"
    bench("exact_rows_micro", "--smoke", "--rows", "2", "--out", out)
    for shape, row in read(out).items():
        errs = {k: v for k, v in row.items() if k.startswith("fma") and k.endswith("_err")}
        exact = {k: v for k, v in row.items() if k.endswith("_exact")}
        assert errs and all(v < 2e-2 for v in errs.values()), (shape, errs)
        assert exact and all(v is True for v in exact.values()), (shape, exact)


def test_cuda_quant_micro(bench, tmp_path):
    out = tmp_path / "quant.json"
    bench("cuda_quant_micro", "--smoke", "--sweep", "--out", out)
    r = read(out)
    assert r["rows"]["o_m1"]["int8_rel_err"] < 2e-2 and positive(r["rows"]["o_m128"]["int4_g32_us"])
    assert all(sweep["best"] and not sweep["errors"] for sweep in r["sweep"].values()), r["sweep"]


def test_decode_attention_sweep(bench, tmp_path):
    out = tmp_path / "sweep.json"
    bench("decode_attention_sweep", "--smoke", "--json", out)
    (rows,) = read(out).values()
    assert len(rows) == 2 and all(row["max_err"] < 2e-2 for row in rows), rows


# ---- vl.py: the Qwen2-VL benchmark on tests/vl_cases' tiny model ----------------------------------------------------
def test_vl_tiny_runs(bench, tmp_path):
    """vl.py --model tiny: concurrent image requests against transformers' batched generate, the text-only prefill,
    multi-turn with the same image (a prefix-cache hit) and with a fresh one (none), the tower alone."""
    out = tmp_path / "vl.json"
    bench("vl", "--model", "tiny", "--rounds", "1", "--requests", "3", "--tokens", "3", "--image-size", "56",
          "--out", out)
    r = read(out)
    c, m = r["concurrent"], r["multi_turn"]
    for v in ("allspark", "transformers", "allspark_text_only"):
        assert positive(c[v]["ttft_median_s"], c[v]["ttft_p90_s"], c[v]["tokens_per_s"]), c[v]
    assert positive(c["transformers_ttft_over_allspark_median"], c["allspark_tps_over_transformers"])
    assert c["first_tokens_equal"] == [3]                   # fp32: the same first tokens as transformers
    assert m["hit_prefix_cache_tokens"] > 0 and m["miss_prefix_cache_tokens"] == 0, m
    assert positive(m["turn2_ttft_hit_s"], m["turn2_ttft_miss_s"], *r["vision_tower"].values())
