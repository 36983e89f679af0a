"""Peak rate of the AVX-512 multiply-add instructions the quantized GEMV is built on, one core: vpdpbusd (bytes, 64
multiply-adds each), vpdpwssd (words, 32), vpmaddubsw (bytes into int16 pairs) and, on AVX-512 BF16 CPUs, vdpbf16ps
(bf16 pairs into fp32, 32: the dense bf16 GEMM's), each over NA independent
accumulators (enough of them to hide the latency). The GEMV's best case at many rows of x is this rate times the
multiply-adds per instruction; the number a GEMV reaches over it says how much is left.

    python benchmarks/vnni_peak.py [--iterations 20000000]

Compiles the loops below into a small shared library with the C++ compiler (g++, or $CXX; about a second) and calls
them through ctypes. Prints instructions per second and multiply-adds per second per core. AVX-512 VNNI CPUs only:
elsewhere it compiles, says so and exits (--compile-only stops there anyway).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
template <int OP, int NA>
__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) int64_t loop(int64_t n) {
  __m512i acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3);
  __m512i b[NA];   // one second operand per accumulator: no two products are the same value (the compiler would
  for (int i = 0; i < NA; ++i) b[i] = _mm512_set1_epi8(static_cast<char>(5 + i));   // compute a shared one once)
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < NA; ++i) {   // unrolled, so the accumulators stay in registers (a loop keeps them on the stack)
      if constexpr (OP == 0) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b[i]);
      else if constexpr (OP == 1) acc[i] = _mm512_dpwssd_epi32(acc[i], a, b[i]);
      else acc[i] = _mm512_add_epi16(acc[i], _mm512_maddubs_epi16(a, b[i]));
    }
    asm volatile("" : "+v"(a));   // the inputs stay opaque: nothing is hoisted out of the loop
  }
  __m512i s = acc[0];
  for (int i = 1; i < NA; ++i) s = _mm512_add_epi32(s, acc[i]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, s);
  return lanes[0];
}
// vdpbf16ps: bf16 pairs into fp32 (AVX-512 BF16), the dense bf16 GEMM's instruction
template <int NA>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline)) int64_t loop_bf16(int64_t n) {
  __m512 acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = _mm512_set1_ps(i);
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
  __m512bh b[NA];
  for (int i = 0; i < NA; ++i) b[i] = (__m512bh)_mm512_set1_epi16(static_cast<short>(0x3f80 + i));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < NA; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b[i]);
    asm volatile("" : "+v"(a));
  }
  __m512 s = acc[0];
  for (int i = 1; i < NA; ++i) s = _mm512_add_ps(s, acc[i]);
  return static_cast<int64_t>(_mm512_reduce_add_ps(s));
}
extern "C" int64_t run(int64_t op, int64_t n) {
  return op == 0 ? loop<0, 12>(n) : op == 1 ? loop<1, 12>(n) : op == 2 ? loop<2, 12>(n) : loop_bf16<12>(n);
}
"""
ACCUMULATORS = 12
OPS = (("vpdpbusd zmm", 64), ("vpdpwssd zmm", 32), ("vpmaddubsw zmm (+ vpaddw)", 64), ("vdpbf16ps zmm", 32))
BF16_OP = 3   # measured only where the CPU has AVX-512 BF16


def build(out_dir: str) -> ctypes.CDLL:
    """SOURCE compiled into out_dir and loaded: its run(op, n)."""
    src, lib = os.path.join(out_dir, "vnni_peak.cpp"), os.path.join(out_dir, "vnni_peak.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", src, "-o", lib], check=True)
    dll = ctypes.CDLL(lib)
    dll.run.argtypes, dll.run.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    return dll


def has_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read().split()
    except OSError:
        return False


def has_vnni() -> bool:
    return has_flag("avx512_vnni")


def rate(lib: ctypes.CDLL, op: int, iterations: int) -> float:
    """Instructions per second of loop `op` on one core."""
    lib.run(op, 1000)   # warm up
    t = time.perf_counter()
    lib.run(op, iterations)
    return iterations * ACCUMULATORS / (time.perf_counter() - t)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20_000_000)
    p.add_argument("--compile-only", action="store_true", help="build the loops, run nothing")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        ext = build(d)
    if args.compile_only:
        return
    if not has_vnni():
        print("this CPU has no AVX-512 VNNI: nothing to measure")
        return
    for op, (name, macs) in enumerate(OPS):
        if op == BF16_OP and not has_flag("avx512_bf16"):
            continue
        r = rate(ext, op, args.iterations)
        print(f"{name:<28} {r / 1e9:6.2f} G instructions/s   {r * macs / 1e9:7.1f} G multiply-adds/s (one core)")


if __name__ == "__main__":
    main()
