"""The benchmark harness still runs end to end (README's performance table comes from it): the quick,
decode-only path on fp32, our Engine against transformers, and llama.cpp on the same weights (an f32 GGUF,
its logits checked against transformers') when llama-cpp-python and gguf are installed. Numbers are
checked for sanity only; timings are never asserted in the test suite."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from pool_helpers import REPO, repo_env


def test_benchmark_quick_decode_only_runs(tmp_path):
    out = tmp_path / "results.json"
    env = dict(repo_env(), HOME=str(tmp_path))          # the benchmark model is built under ~/.cache
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--quick", "--decode-only", "--no-pool",
                           "--dtypes", "float32", "--llamacpp-check", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "batch-1 decode / roofline" in proc.stdout
    report = json.loads(out.read_text())
    assert report["quick"] and report["decode_only"]
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


def test_one_loop_reader_times_every_token(served_llama):
    """The concurrency rows' asyncio reader (workloads.token_times_one_loop, the HTTP server's QueueReader) sees
    each request's every token once, in order: as many arrival times as tokens, never decreasing; and it
    releases every request it started."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
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
