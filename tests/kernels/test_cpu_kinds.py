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
    monkeypatch.setattr(ops, "cpu_flags", lambda: frozenset(flags))
    ops.isa_level.cache_clear()
    try:
        paths = ops.cpu_paths()
        assert (paths["isa"], paths["bf16_gemm"], paths["int8_gemm"]) == want
    finally:
        ops.isa_level.cache_clear()
