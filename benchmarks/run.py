"""allspark's benchmark: one command, one run, everything side by side on the same machine and threads.

    python benchmarks/run.py [--quick | --smoke] [--features] [--decode-only] [--dtypes bfloat16 float32]
                             [--quant int8 int4_g32] [--kv int8 uint4 [--kv-weights int4_g64]] [--json PATH]

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
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.spin_openmp()    # before torch loads: transformers shares this process with the Engine (common.py says why)

import cpu_bench  # noqa: E402
import llamacpp_peer as LP  # noqa: E402
import machine  # noqa: E402
import torch  # noqa: E402


def measure_name(a) -> str:
    """The measure a run's flags make, the first part of its default result file's name."""
    if a.device == "cuda":
        return "cuda"
    return "features" if a.features else "quant" if a.quant else "kv" if a.kv else "engines"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model and fewer runs (< 3 minutes)")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round and small bandwidth arrays: "
                   "checks that every path runs (tests/models/test_benchmark_smoke.py; the numbers mean nothing)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--no-pool", action="store_true", help="skip the 2-rank pool")
    p.add_argument("--decode-only", action="store_true", help="only the batch-1 decode rows (kernel work)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (kernel work on our own engines)")
    p.add_argument("--ttft", action="store_true", help="with --decode-only: also the Engine's TTFT rows")
    p.add_argument("--quant", nargs="*", default=[], metavar="FORMAT[_gGROUP]",
                   help="also serve the weights quantized, e.g. int8 int4_g32 uint4_g64 int8+head int8+a8 "
                        "(InstantQuant)")
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
    a = p.parse_args(argv)
    if a.kv_weights and (a.kv_weights not in a.quant or not a.kv):
        p.error(f"--kv-weights {a.kv_weights} needs --kv and the same variant in --quant (--quant: {a.quant})")
    a.json = a.json or common.result_path(measure_name(a), a.device, a.quick or a.smoke)
    if a.smoke:
        machine.ARRAY_FLOATS = 1 << 20      # 4 MiB arrays: the bandwidth calls run, quickly
    if a.device == "cuda":
        import cuda_bench
        save = functools.partial(common.write_report, a.json)
        report = cuda_bench.main(a, save)
        save(report)
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}, indent=1))
        return
    spec = common.spec_of(a)
    if a.rounds:
        spec = dict(spec, decode_repeats=a.rounds)
    if a.ttft_repeats:
        spec = dict(spec, repeats=a.ttft_repeats)
    if a.features:
        import serving_features

        def save(report):
            report["machine"] = common.machine_name()
            common.write_report(a.json, report)
        torch.set_num_threads(a.threads)
        earlier = None
        if a.sections and os.path.exists(a.json):   # keep the sections not run now
            with open(a.json) as f:
                earlier = json.load(f)
        sizes = serving_features.SMOKE_SIZES if a.smoke else serving_features.FULL_SIZES
        save(serving_features.main(spec, save, a.sections or serving_features.SECTIONS, earlier, sizes))
        return
    why_not = LP.missing() if a.llamacpp is not False else None
    if why_not:
        print(why_not)
    a.llamacpp = a.llamacpp is not False and why_not is None
    torch.set_num_threads(a.threads)
    t0 = time.time()
    cpu = common.machine_name()
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
        report["dtypes"][dtype] = cpu_bench.run_dtype(dtype, spec, a.threads, not a.no_pool, a.decode_only,
                                                      a.quant, a.ttft, not a.no_hf, a.llamacpp,
                                                      a.llamacpp and a.llamacpp_check, a.kv, a.kv_weights)
    report["wall_s"] = time.time() - t0
    print("\n".join(cpu_bench.summarize(report)))
    print(f"\n({report['wall_s']:.0f} s)")
    common.write_report(a.json, report)


if __name__ == "__main__":
    main()
