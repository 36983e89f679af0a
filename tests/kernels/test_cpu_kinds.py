"""The CPU features the kernels' paths depend on, named, and the machine kinds the tests have passed on.

Our kernels pick a path by the CPU's features (compute/ops.py isa_level, gemm_dtype, int8_gemm_suits), and so do
ATen's and oneDNN's GEMMs under them. The exactness bounds of the kernel and model tests hold on the kinds below,
where the suite has run. A CPU whose features make another combination fails here, naming them, so that a machine
kind the suite never met shows up as a failed test there instead of as a wrong answer: run the kernel and model
tests on it and add its kind."""
from __future__ import annotations

import pytest

from allspark_client.cpu_features import cpu_flags, normalized
from allspark_server.compute import ops

# (isa level, bf16 prompt GEMM, int8 prompt GEMM) -> the machines the tests have passed on with those paths
KNOWN_KINDS = {
    ("1:avx2+fma", "fp32-widened", "dequantized"): "Zen 2/3-class VMs (AVX2 only)",
    ("4:avx512-vnni+bf16", "bf16", "dequantized"): "the Zen 4 VM; the Intel Xeon VM (AVX-512 FP16, no AMX exposed)",
}
# not yet: AMX hosts (the GPU machines' Sapphire Rapids CPUs, torch 2.11): the int8-activation GGUF tests pass there,
# but a TORCH_CHECK raised in linear_widened ended the process (SIGSEGV) in test_native.py
# features our paths or the libraries' kernels under them dispatch on: the report names the ones present
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx512_fp16",
            "amx_bf16", "amx_int8")


def test_this_cpu_is_a_kind_the_tests_have_met():
    paths = ops.cpu_paths()
    kind = (paths["isa"], paths["bf16_gemm"], paths["int8_gemm"])
    present = sorted(f for f in FEATURES if f in cpu_flags())
    print(f"CPU features {present}: kernel paths {paths} ({KNOWN_KINDS.get(kind, 'a kind not met before')})")
    if ops.native() is None:
        pytest.skip("the native extension is not built: only the PyTorch path runs")
    assert kind in KNOWN_KINDS, (f"this CPU (features {present}) makes the kernel paths {paths}, a combination the "
                                 f"tests have not passed on before ({sorted(KNOWN_KINDS)}): run the kernel and "
                                 f"model tests here and add the kind to KNOWN_KINDS")


def _paths_of(monkeypatch, flags: frozenset) -> tuple:
    """ops.cpu_paths() (isa, bf16 GEMM, int8 GEMM) as on a CPU with these flags."""
    monkeypatch.setattr(ops, "cpu_flags", lambda: flags)
    ops.isa_level.cache_clear()
    try:
        paths = ops.cpu_paths()
        return paths["isa"], paths["bf16_gemm"], paths["int8_gemm"]
    finally:
        ops.isa_level.cache_clear()


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma"}, ("1:avx2+fma", "fp32-widened", "dequantized")),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}, ("2:avx512f+bw+vl", "fp32-widened", "dequantized")),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, ("3:avx512-vnni", "fp32-widened",
                                                                        "dequantized")),
    (normalized({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16"}),   # py-cpuinfo's
     ("4:avx512-vnni+bf16", "bf16", "dequantized")),                                                # names
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"},
     ("4:avx512-vnni+bf16", "bf16", "amx_int8")),
    ({"sse4_2"}, ("0:portable", "fp32-widened", "dequantized")),
], ids=["avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx", "portable"])
def test_each_feature_set_picks_its_paths(monkeypatch, flags, want):
    """The features -> paths table, for kinds of CPU this machine is not."""
    assert _paths_of(monkeypatch, frozenset(flags)) == want


# a Sapphire Rapids host's flags (the GPU machines' CPUs): every level of ALLSPARK_CPU_ISA hides some of them
SAPPHIRE_RAPIDS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512cd",
                             "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                             "amx_int8"})


@pytest.mark.parametrize("level, want", [
    ("auto", ("4:avx512-vnni+bf16", "bf16", "amx_int8")),
    ("avx512_bf16", ("4:avx512-vnni+bf16", "bf16", "dequantized")),
    ("avx512_vnni", ("3:avx512-vnni", "fp32-widened", "dequantized")),
    ("avx512", ("2:avx512f+bw+vl", "fp32-widened", "dequantized")),
    ("avx2", ("1:avx2+fma", "fp32-widened", "dequantized")),
    ("portable", ("0:portable", "fp32-widened", "dequantized")),
])
def test_a_cpu_isa_cap_runs_the_paths_of_an_older_kind(monkeypatch, level, want):
    """ALLSPARK_CPU_ISA: the flags above the level are hidden, and the paths are those of a CPU without them."""
    from allspark_client.cpu_features import capped
    flags = capped(SAPPHIRE_RAPIDS, level)
    assert flags <= SAPPHIRE_RAPIDS and "sse4_2" in flags
    if level == "avx2":     # an AVX2-only kind: neither AVX-512 nor AVX-VNNI nor AMX
        assert flags == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert _paths_of(monkeypatch, flags) == want


CAPPED_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers import greedy, serialize, start_engine
from allspark_server.compute import ops
engine = start_engine(serialize({hf_dir!r}, "m", {out!r}), "m", max_batch=2)
tokens = greedy(engine, "m", {ids!r}, 12)
print(json.dumps({{"paths": ops.cpu_paths(), "kernels": ops.describe(), "tokens": tokens}}))
"""


@pytest.mark.skipif(ops.native() is None or ops.isa_level() < ops.ISA_AVX512, reason="the CPU is AVX2 or older")
def test_an_engine_capped_at_avx2_runs_the_avx2_kernels_and_matches_transformers(llama, tmp_path):
    """The cap end to end, where the CPU has AVX-512: an Engine in a process with ALLSPARK_CPU_ISA=avx2 says it runs
    the AVX2 kernels, and its greedy tokens are transformers' (fp32)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import hf_greedy, random_prompt
    ids = random_prompt(24, seed=7)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = CAPPED_RUN.format(tests=tests, hf_dir=llama.hf_dir, out=str(tmp_path), ids=ids)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ALLSPARK_CPU_ISA": "avx2"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["kernels"] == "native, AVX2+FMA" and got["paths"]["isa"] == "1:avx2+fma", got
    assert got["tokens"] == hf_greedy(llama.model, ids, 12)
