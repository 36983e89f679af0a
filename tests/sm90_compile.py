"""Compiles the decode GEMVs (quantized, and dense with and without a LoRA shrink), the LoRA launches, the
peer-memory allreduce and the decode attention's Triton kernels for a Hopper GPU (sm_90) without one, run as a
script in a process whose kernels are not interpreted (TRITON_INTERPRET unset): Triton's compiler and the ptxas its
wheel ships turn each variant into a cubin. Prints one line per variant, `ok NAME` or `FAIL NAME: error`; exit
status 1 on a failure (test_triton_compile_sm90.py runs it)."""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from allspark_server.compute.cuda import (
    decode_attention,
    fp8_matmul,
    gemv_kernels,
    lora_grouped,
    lora_kernels,
    peer_allreduce,
    quant_gemv,
    quant_kernels,
)
from allspark_server.quant.formats import FORMAT_IDS

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {"x": "*bf16", "qw": "*u8", "scales": "*fp32", "zeros": "*fp32", "out": "*fp32"}


def compile_for_hopper(kernel, pointers: dict[str, str], constants: dict) -> str:
    """The kernel's PTX for sm_90 (the cubin assembled too); arguments not in `pointers` or `constants`: i32."""
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in constants.items()})
    compiled = triton.compile(src, target=HOPPER)
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


def gemv(fmt: str, group: int, silu_mul: bool = False) -> str:
    k = 4096
    block_k = k if group == -1 else 2048
    return compile_for_hopper(quant_gemv.quant_gemv_kernel, dict(POINTERS, out="*bf16") if silu_mul else POINTERS, dict(
        FMT=FORMAT_IDS[fmt], GROUP=k if group == -1 else group, HAS_ZERO=fmt == "uint4", HAS_MIN=0, BLOCK_M=1,
        BLOCK_N=4, BLOCK_K=block_k, SUB=min(block_k, k if group == -1 else group), EVICTION="evict_first",
        SILU_MUL=silu_mul, SOFT_BF16=False, PDL=True))


def tensor_core_tiles(fmt: str) -> str:
    return compile_for_hopper(quant_kernels._quant_matmul_kernel, POINTERS, dict(
        FMT=FORMAT_IDS[fmt], GROUP=4096, HAS_ZERO=False, HAS_MIN=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
        DOT_DTYPE=triton.language.bfloat16, UPCAST=False))


def dequantize(fmt: str) -> str:
    return compile_for_hopper(quant_gemv.dequantize_kernel, dict(POINTERS, out="*bf16"), dict(
        FMT=FORMAT_IDS[fmt], GROUP=4096, HAS_ZERO=False, HAS_MIN=False, BLOCK_N=32, BLOCK_K=256))


def decode_over_spans(quant: int) -> str:
    """The decode attention over quantized spans (QUANT 1 int8, 3 fp8's bytes; 0: bf16 spans, rotating q and k
    with LoRA deltas added as they load), 4 query heads a KV head, D 128."""
    cache = {0: "*bf16", 1: "*i8"}.get(quant, "*u8")
    pointers = {"q": "*bf16", "k_cache": cache, "v_cache": cache, "k_param": "*fp32", "v_param": "*fp32",
                "spans": "*i32", "ctx": "*i32", "slopes": "*i32", "out": "*bf16", "m_part": "*fp32",
                "l_part": "*fp32", "acc_part": "*fp32", "counters": "*i32", "k_new": "*bf16", "v_new": "*bf16",
                "cos": "*bf16", "sin": "*bf16", "slots": "*i32", "delta": "*fp32", "qk_scale": "fp32", "cap": "fp32"}
    return compile_for_hopper(decode_attention._decode_kernel, pointers, dict(
        G=4, P=32, D=128, NUM_SPLITS=4, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32", UPCAST=False,
        HAS_ALIBI=False, QUANT=quant, ROTARY=quant == 0, COMBINE=True, BLOCK_S=4, FENCE=True, SOFT_BF16=False,
        PDL=True, HAS_SOFTCAP=False, HAS_WINDOW=False, HAS_DELTA=quant == 0))


def dense_gemv(silu_mul: bool, shrink: bool) -> str:
    """The bf16 decode GEMV, carrying a LoRA adapter's shrink programs or not (7B's tile)."""
    pointers = {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "out": "*bf16", "a_stack": "*bf16", "slots": "*i64",
                "part": "*fp32"}
    return compile_for_hopper(gemv_kernels._gemv_kernel, pointers, dict(
        BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, HAS_BIAS=False, SILU_MUL=silu_mul, SHRINK=shrink, BLOCK_R=16, CHUNK=256,
        EVICTION="evict_first", SOFT_BF16=False, PDL=True))


def lora_launches() -> str:
    """The shrink and the expand a row a program, and the grouped shrink and expand on tensor cores."""
    pointers = {"x": "*bf16", "a": "*bf16", "b": "*bf16", "y": "*bf16", "slots": "*i64", "part": "*fp32",
                "t": "*bf16", "counters": "*i32"}
    shrink = compile_for_hopper(lora_kernels._shrink_kernel, pointers, dict(
        BLOCK_R=16, BLOCK_K=256, CHUNK=256, PDL=True))
    expand = compile_for_hopper(lora_kernels._expand_kernel, pointers, dict(
        BLOCK_N=256, BLOCK_R=16, BLOCK_S=16, SOFT_BF16=False, PDL=True))
    grouped_shrink = compile_for_hopper(lora_grouped._grouped_shrink_kernel, pointers, dict(
        SPLITS=8, BLOCK_T=32, BLOCK_R=64, BLOCK_K=128, DOT_PREC="tf32", SOFT_BF16=False, PDL=True))
    grouped = compile_for_hopper(lora_grouped._grouped_expand_kernel, pointers, dict(
        BLOCK_T=32, BLOCK_N=128, BLOCK_R=16, DOT_PREC="tf32", INTO_DELTA=False, SOFT_BF16=False, PDL=True))
    into_delta = compile_for_hopper(lora_grouped._grouped_expand_kernel, dict(pointers, y="*fp32"), dict(
        BLOCK_T=32, BLOCK_N=128, BLOCK_R=16, DOT_PREC="tf32", INTO_DELTA=True, SOFT_BF16=False, PDL=True))
    for name, ptx in (("shrink", grouped_shrink), ("expand", grouped), ("expand into a delta", into_delta)):
        assert "mma" in ptx, f"the grouped {name}'s product is not on tensor cores"
    return shrink + expand + grouped_shrink + grouped + into_delta


def fp8_rows() -> str:
    return compile_for_hopper(fp8_matmul._round_rows_kernel, {"x": "*bf16", "codes": "*u8", "scales": "*fp32",
                                                              "rounded": "*u8"}, dict(BLOCK_K=2048, CODES=True))


def peer_allreduces() -> str:
    """Both protocols of the peer-memory allreduce, bf16 between 2 ranks."""
    pointers = {"x": "*bf16", "buffers": "*i64", "slot_of_call": "*i32", "done": "*i32"}
    flags = compile_for_hopper(peer_allreduce._peer_allreduce_kernel, pointers, dict(
        RANK=0, WORLD=2, MAXP=64, BLOCK=1024, SOFT_BF16=False))
    sentinel = compile_for_hopper(peer_allreduce._sentinel_allreduce_kernel, pointers, dict(
        RANK=1, WORLD=2, BLOCK=1024, BITS=triton.language.int16, SENTINEL=-(1 << 15), SOFT_BF16=False))
    assert "ld.volatile" in sentinel, "the sentinel protocol's spin does not reload from memory"
    return flags + sentinel


# name -> (build, what its PTX must contain)
VARIANTS = {
    "gemv bf16": (lambda: dense_gemv(False, False), "griddepcontrol"),
    "gemv bf16 carrying a LoRA shrink": (lambda: dense_gemv(False, True), "griddepcontrol"),
    "gemv bf16 silu_mul": (lambda: dense_gemv(True, False), "griddepcontrol"),
    "LoRA shrink and expand launches": (lora_launches, "griddepcontrol"),
    "W8A8 rows rounded to e4m3": (fp8_rows, "div.rn.f32"),
    "peer-memory allreduce, flags and sentinel": (peer_allreduces, "atom"),
    "gemv fp8_e4m3 per channel": (lambda: gemv("fp8_e4m3", -1), "e4m3"),
    "gemv fp8_e4m3 g128": (lambda: gemv("fp8_e4m3", 128), "e4m3"),
    "gemv fp8_e4m3 silu_mul": (lambda: gemv("fp8_e4m3", -1, silu_mul=True), "e4m3"),
    "gemv int8 per channel": (lambda: gemv("int8", -1), ""),
    "gemv uint4 g64": (lambda: gemv("uint4", 64), ""),
    "tensor-core tiles fp8_e4m3": (lambda: tensor_core_tiles("fp8_e4m3"), "mma"),
    "tensor-core tiles int8": (lambda: tensor_core_tiles("int8"), "mma"),
    "dequantize fp8_e4m3": (lambda: dequantize("fp8_e4m3"), "e4m3"),
    "dequantize int8": (lambda: dequantize("int8"), ""),
    "decode attention over fp8 spans": (lambda: decode_over_spans(3), "e4m3"),
    "decode attention over int8 spans": (lambda: decode_over_spans(1), "mma"),
    "decode attention rotating q and k with LoRA deltas": (lambda: decode_over_spans(0), "griddepcontrol"),
}


def main() -> int:
    failed = 0
    for name, (build, must_contain) in VARIANTS.items():
        try:
            ptx = build()
            assert must_contain in ptx, f"the PTX has no {must_contain!r}"
            print(f"ok {name}", flush=True)
        except Exception as e:
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            print(f"FAIL {name}: {type(cause).__name__}: {str(cause)[-600:]}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
