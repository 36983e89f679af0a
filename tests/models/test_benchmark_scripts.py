"""The rest of benchmarks/ on tiny shapes, once in CI (the harness and the GPU scripts: test_benchmark_smoke.py): the
CPU kernels' micro-benchmarks, the Engine's scripts on the tiny model, the GGUF race against llama.cpp and the 2-host
pool. Scripts run in this process (each one's main(argv)) unless their point is a process of their own; numbers are
checked for sanity only, timings never. What llama-cpp-python (not in requirements.txt), root with network namespaces
or the native build are missing for skips, saying which. results_table.py, results_readers.py and
results_measures.py are tests/unit/test_results_table.py's (unit tier).
"""
from __future__ import annotations

import os

import pytest
from bench_helpers import BENCH, llamacpp_missing, positive, read
from pool_helpers import REPO


# ---- CPU kernels' micro-benchmarks ---------------------------------------------------------------------------------
def test_cpu_decode_attention(bench, tmp_path):
    out = tmp_path / "attention.json"
    bench("cpu_decode_attention", "--contexts", "64", "--rounds", "1", "--json", out)
    for row in read(out)["results"].values():
        assert positive(*(row[m]["ms_per_step"] for m in ("bf16", "int8", "uint4"))), row


def test_gemv_quant_micro(bench, capsys):
    from allspark_server.compute import ops
    if ops.native() is None:
        pytest.skip("the native extension is not built")
    bench("gemv_quant_micro", "--shape", "64", "64", "--layers", "1", "--rounds", "1", "--a8", "--bound", "--gemm",
          "--formats", "int8:-1", "uint4_min:32", "--base", "int8:-1")
    out = capsys.readouterr().out
    assert "read uint4_min g32" in out and "uint4_min g32+a8 deq+gemm" in out, out


def test_vnni_peak(bench, capsys):
    bench("vnni_peak", "--iterations", "1000")
    out = capsys.readouterr().out
    assert "G multiply-adds/s" in out or "no AVX-512 VNNI" in out, out


def test_prefill_gemm(bench, tmp_path):
    from allspark_server.compute import ops
    if ops.native() is None:
        pytest.skip("the native extension is not built")
    out = tmp_path / "prefill.json"
    bench("prefill_gemm", "--rows", "13", "--layers", "1", "--rounds", "1", "--formats", "int4:32", "--json", out)
    rows = read(out)["rows"]["13"]
    assert {"bf16 dense gemm", "int4 g32 dequantized", f"int4 g32 native isa{ops.isa_level()}"} == set(rows), rows
    assert positive(*(v["macs_per_s"] for v in rows.values()))


def test_prefill_attention_micro(bench, tmp_path):
    from allspark_server.compute import ops
    if ops.native() is None or ops.isa_level() < ops.ISA_AVX2:
        pytest.skip("the native prefill attention needs the native extension and AVX2")
    out = tmp_path / "attention.json"
    bench("prefill_attention_micro", "--lengths", "40", "--dtypes", "float32", "--rounds", "1", "--reps", "1",
          "--json", out)
    row = read(out)["results"]["float32 40"]
    assert positive(row["native_ms"], row["sdpa_ms"], row["sdpa_over_native"]), row


# ---- the Engine's scripts on the tiny model --------------------------------------------------------------------------
def test_int8_gemm(bench, tmp_path):
    out = tmp_path / "int8.json"
    bench("int8_gemm", "--smoke", "--prompts", "16", "--repeats", "1", "--json", out)
    assert positive(read(out)["ttft"]["16"]["int8_gemm_vs_bf16"])


def test_moe(bench, tmp_path):
    out = tmp_path / "moe.json"
    bench("moe", "--smoke", "--json", out)
    r = read(out)
    assert r["bytes_per_token"]["active"] < r["bytes_per_token"]["all"] and positive(r["concurrent_2"]["ratio"])


def test_quant_accuracy(bench, tmp_path):
    out = tmp_path / "accuracy.json"
    bench("quant_accuracy", "--smoke", "--positions", "64", "--json", out)
    r = read(out)
    assert r["stats"]["trained-like"]["int8 g-1"]["rel_logit_error"] < 0.1
    assert 0 <= r["greedy32"]["int8_vs_bf16_all"] <= 1


def test_gpu_ttft_profile_on_cpu(bench, tmp_path):
    bench("gpu_ttft_profile", "--device", "cpu", "--cases", "tiny-bf16", "tiny-int8_g32", "--prompt", "16",
          "--repeats", "1", "--out", tmp_path)
    r = read(tmp_path / "ttft_profile.json")
    assert positive(r["tiny-bf16"]["ttft_ms"], r["tiny-int8_g32"]["phases_ms"]["execute_host"])


def test_op_profile_table_and_ab_trees(bench, tmp_path, capsys):
    """op_profile_overhead.py's op table in this process, and ab_trees.py's two engines in their own processes
    taking turns (op_profile_overhead.py's arms are the same workers)."""
    bench("op_profile_overhead", "--smoke", "--table", "--tokens", "4")
    assert "the ops cover" in capsys.readouterr().out
    out = tmp_path / "ab.json"
    bench("ab_trees", "--old", REPO, "--smoke", "--variants", "int8", "--turns", "1", "--tokens", "4", "--out", out)
    assert positive(read(out)["median_ratio"]["int8"])


def test_batch_invariance(bench, tmp_path):
    from allspark_server.compute import ops
    if ops.native() is None:
        pytest.skip("batch-invariant mode needs the native kernels")
    out = tmp_path / "invariance.json"
    bench("batch_invariance", "--smoke", "--json", out)
    r = read(out)["models"]["bench"]
    assert r["differ_from_solo"]["on"] == 0 and set(r["on_over_off"]) == {"decode_b1_tps", "c32_tps", "c32_decode_tps",
                                                                 "ttft_512_s"}
    assert all(v > 0 for v in r["on_over_off"].values())


def test_lora(bench, tmp_path):
    """lora.py on the tiny model: 2 random PEFT adapters loaded, batch 1 with and without one, 2 streams over them."""
    out = tmp_path / "lora.json"
    bench("lora", "--model", "tiny", "--dtype", "float32", "--tokens", "4", "--streams", "2", "--adapters", "2",
          "--rounds", "1", "--out", out)
    r = read(out)
    d, s = r["decode_b1"], r["streams_total"]
    assert positive(d["base_tps"], d["adapter_tps"], d["adapter_over_base"], d["lora_model_base_over_base"])
    assert positive(s["base_tps"], s["adapters_tps"], s["adapters_over_base"]) and len(s["by_round"]) == 1
    w = r["streams_decode_steps"]     # the tokens after every stream's first: 3 steps of 2 rows
    assert positive(w["base_tps"], w["adapters_tps"], w["adapters_over_base"]) and len(w["by_round"]) == 1
    assert r["adapter_changes_output"] and r["lora_model_base_greedy_equal"], r    # the adapter is applied; fp32


def test_install_memory(bench, tmp_path):
    out = tmp_path / "memory.json"
    bench("install_memory", "--smoke", "--variants", "int8", "--prompt", "8", "--max-length", "64", "--json", out)
    r = read(out)["variants"]["int8"]
    assert r["rss"]["install"] > r["rss"]["imports"] and r["weight_bytes"] > 0


def test_serve(bench, tmp_path):
    out = tmp_path / "serve.json"
    bench("serve", "--smoke", "--requests", "2", "--repeats", "1", "--sequential", "1", "--prompt", "8",
          "--max-tokens", "4", "--threads", "1", "--json", out)
    assert positive(read(out)["http_vs_engine"]["output_throughput_ratio"])


def test_stream_profile(bench, tmp_path):
    """Our side of the GGUF race (gguf_race.py's Ours) on a Q8_0 file llamacpp_peer.py writes, profiled."""
    from allspark_server.compute import ops
    if ops.native() is None:
        pytest.skip("the native extension is not built")
    out = tmp_path / "streams.json"
    bench("stream_profile", "--smoke", "--file", "q8_0+head", "--streams", "2", "--new-tokens", "4", "--json", out)
    r = read(out)
    assert positive(r["decode_step_ms"], r["ops"]["qkv_proj"]["gmac_per_s"])


def test_accuracy_table(bench, tmp_path):
    """On the tiny model's Q4_1 file (SmolLM2's takes minutes to dequantize for transformers' reference)."""
    out = tmp_path / "table.json"
    bench("accuracy_table", "--smoke", "--weights", "bf16", "q4_1", "--kv", "dense", "int8", "--json", out)
    rows = read(out)["rows"]
    assert len(rows) == 4 and all(row["kl_mean"] < 1 and row["decode_check"] for row in rows), rows


# ---- llama.cpp, 2-host pools ---------------------------------------------------------------------------------------
def test_gguf_race_rescore(bench, tmp_path):
    """--rescore needs no llama.cpp: a recorded race's ratios computed again from its rounds; the host-load meter
    its rounds record."""
    out = tmp_path / "race.json"
    race = bench("gguf_race", "--rescore", os.path.join(BENCH, "results", "gguf-race-zen4.json"), "--json", out)
    r = read(out)
    assert all(positive(*rep["ratios"].values()) for rep in r["files"].values())
    assert race.host_load.wait_quiet(max_cores=64, timeout_s=0, window_s=0.05)["quiet_window_others_cores"] >= 0


@pytest.mark.parametrize("script", ["gguf_race", "gguf_race_gpu"])
def test_gguf_race(bench, tmp_path, script):
    """The race on the tiny model's Q8_0 file (gguf_race_gpu.py with --device cpu, its smoke path); without
    llama-cpp-python the script parses its arguments and refuses, saying why."""
    out = tmp_path / "race.json"
    device = ["--device", "cpu"] if script == "gguf_race_gpu" else []
    argv = ["--smoke", *device, "--files", "q8_0+head", "--rounds", "1", "--concurrency", "2", "--json", out]
    if why := llamacpp_missing():
        with pytest.raises(SystemExit, match="llama.cpp peer skipped"):
            bench(script, *argv)
        pytest.skip(why)
    bench(script, *argv)
    assert positive(*read(out)["files"]["q8_0+head"]["ratios"].values())


def test_multi_host(bench, tmp_path):
    from netns_hosts import NetnsHosts
    if why := NetnsHosts.unavailable():
        pytest.skip(why)
    out = tmp_path / "hosts.json"
    bench("multi_host", "--smoke", "--json", out)
    r = read(out)
    assert r["same_greedy_tokens"] and positive(r["two_hosts_over_one_host"])
