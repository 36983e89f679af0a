"""Peak rate of the AVX-512 multiply-add instructions the quantized GEMV is built on, one core: vpdpbusd (bytes, 64
multiply-adds each), vpdpwssd (words, 32) and vpmaddubsw (bytes into int16 pairs), each over NA independent
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
  const __m512i b = _mm512_set1_epi8(5);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < NA; ++i) {   // unrolled, so the accumulators stay in registers (a loop keeps them on the stack)
      if constexpr (OP == 0) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      else if constexpr (OP == 1) acc[i] = _mm512_dpwssd_epi32(acc[i], a, b);
      else acc[i] = _mm512_add_epi16(acc[i], _mm512_maddubs_epi16(a, b));
    }
    asm volatile("" : "+v"(a));   // the inputs stay opaque: nothing is hoisted out of the loop
  }
  __m512i s = acc[0];
  for (int i = 1; i < NA; ++i) s = _mm512_add_epi32(s, acc[i]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, s);
  return lanes[0];
}
extern "C" int64_t run(int64_t op, int64_t n) {
  return op == 0 ? loop<0, 12>(n) : op == 1 ? loop<1, 12>(n) : loop<2, 12>(n);
}
"""
ACCUMULATORS = 12
OPS = (("vpdpbusd zmm", 64), ("vpdpwssd zmm", 32), ("vpmaddubsw zmm (+ vpaddw)", 64))


def build(out_dir: str) -> ctypes.CDLL:
    """SOURCE compiled into out_dir and loaded: its run(op, n)."""
    src, lib = os.path.join(out_dir, "vnni_peak.cpp"), os.path.join(out_dir, "vnni_peak.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", src, "-o", lib], check=True)
    dll = ctypes.CDLL(lib)
    dll.run.argtypes, dll.run.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    return dll


def has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_vnni" in f.read()
    except OSError:
        return False


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
        ext.run(op, 1000)   # warm up
        t = time.perf_counter()
        ext.run(op, args.iterations)
        rate = args.iterations * ACCUMULATORS / (time.perf_counter() - t)
        print(f"{name:<28} {rate / 1e9:6.2f} G instructions/s   {rate * macs / 1e9:7.1f} G multiply-adds/s (one core)")


if __name__ == "__main__":
    main()
