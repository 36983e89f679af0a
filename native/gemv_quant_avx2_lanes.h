// The lanes layout the AVX2 many-row kernels share (gemv_quant_avx2_lanes.cpp: 4-bit codes;
// gemv_quant_avx2_bytes8.cpp: int8 codes): a unit of eight groups of 32 in 8 vectors whose int32 lane j holds 4
// values of group GROUP_OF_LANE[j], so products summed over the 8 vectors leave each group's exact sum in its lane.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace qgemv {

// four vectors' dwords transposed inside each 128-bit lane: v[q] dword L <- v[L] dword q
__attribute__((target("avx2,fma,f16c"))) inline void transpose_lanes(__m256i v[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Eight groups from the 32-byte runs lo[c] / hi[c] (c < 4: groups 2c in the low 128 bits, 2c + 1 in the high; dword d
// of a half: its group's 4 values at positions 4d .. 4d + 3 of the run) into the lanes layout at out
__attribute__((target("avx2,fma,f16c"))) inline void store_lanes(__m256i lo[4], __m256i hi[4], uint8_t* out) {
  transpose_lanes(lo);
  transpose_lanes(hi);
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * q), lo[q]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + q)), hi[q]);
  }
}

// the lane order of a unit's groups: lane j holds group (0, 2, 4, 6, 1, 3, 5, 7)[j]
constexpr int GROUP_OF_LANE[8] = {0, 2, 4, 6, 1, 3, 5, 7};

}  // namespace qgemv
