// What the AVX2 quantized GEMV's two files share (gemv_quant_avx2.cpp: codes widened; gemv_quant_avx2_m1.cpp: nibbles
// and bytes in place): each row of x on its own over tiles of weight rows, the reduction of eight groups' int32 sums
// into one vector and its zero-point and scale epilogue.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemv_quant.h"

namespace qgemv {

// Rows [n0, n1) of y for M rows of x, each (row of x, weight row) pair computed by row(m, n) alone: one row of x
// streams the weight, more go through it a tile of weight rows at a time (tiled_rows), so a row's result never
// depends on the batch.
template <typename RowFn>
inline void rows_each_alone(const QuantView& w, int64_t M, int64_t n0, int64_t n1, RowFn row) {
  if (M == 1) {
    for (int64_t n = n0; n < n1; ++n) row(0, n);
    return;
  }
  tiled_rows(w, M, n0, n1, [&](int64_t m, int64_t mb, int64_t n) {
    for (int64_t r = m; r < m + mb; ++r) row(r, n);
  });
}

// Two hadd trees over groups g .. g + 3 and g + 4 .. g + 7 (each: lanes 0-3 the low halves' sums, 4-7 the high
// halves') into one vector whose lane j is group g + j's whole sum.
__attribute__((target("avx2,fma,f16c")))
inline __m256i eight_in_order(__m256i s0, __m256i s1) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// The sums of q over groups g .. g + 7 (BPG blocks of 32 each) from x's block sums, lane j: group g + j
template <int BPG>
__attribute__((target("avx2,fma,f16c")))
inline __m256i group_sums_of_blocks(const int32_t* qsum, int64_t g) {
  const __m256i* bs = reinterpret_cast<const __m256i*>(qsum + g * BPG);
  __m256i group_q = _mm256_loadu_si256(bs);
  if constexpr (BPG == 2)   // block sums [b0 .. b7], [b8 .. b15] -> pairs, put back in order
    group_q = _mm256_permute4x64_epi64(_mm256_hadd_epi32(group_q, _mm256_loadu_si256(bs + 1)), 0xD8);
  static_assert(BPG == 1 || BPG == 2, "larger groups: Act16::group_sum");
  return group_q;
}

// Eight fp16 values (a unit's scales or mins) from p as fp32; LANE_ORDER: in the lanes' order, words 0, 2, 4, 6, 1,
// 3, 5, 7 (add_eight_groups says which kernels keep it)
template <bool LANE_ORDER>
__attribute__((target("avx2,fma,f16c")))
inline __m256 eight_halves(const at::Half* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (LANE_ORDER)
    bits = _mm_shuffle_epi8(bits, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_cvtph_ps(bits);
}

// Eight groups' exact sums (lane j: group g + j) added to a row's fp32 total: the zero points taken off as
// z_g * (sum of q over the group: group_q, lanes as sums'), then the groups' scales applied in one FMA.
// LANE_ORDER: lane j holds group g + (0, 2, 4, 6, 1, 3, 5, 7)[j], as the batch-1 NIBBLES kernel's reduction leaves
// groups of 32 and (int8 x) of 64; group_q is then in that order too (Act16::block_sum_lanes, Act16::group_sum) and
// the zero points and scales are shuffled to it (row_nibbles_m1_avx2 says why). UINT4_MIN: no zero points; its
// mins (mr, fp16 like the scales) times group_q join the total in one more FMA.
template <int F, bool LANE_ORDER = false>
__attribute__((target("avx2,fma,f16c")))
inline __m256 add_eight_groups(__m256i sums, __m256i group_q, const uint8_t* zr, const at::Half* sr, int64_t g,
                               __m256 total, const at::Half* mr = nullptr) {
  if constexpr (F == INT4) {   // zero point 8
    sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(group_q, 3));
  } else if constexpr (HAS_MIN<F>) {
    total = _mm256_fmadd_ps(eight_halves<LANE_ORDER>(mr + g), _mm256_cvtepi32_ps(group_q), total);
  } else if constexpr (F != INT8) {
    __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zr + g));
    if constexpr (LANE_ORDER) z8 = _mm_shuffle_epi8(z8, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(z8), group_q));
  }
  return _mm256_fmadd_ps(eight_halves<LANE_ORDER>(sr + g), _mm256_cvtepi32_ps(sums), total);
}

// A left-over group (after the runs of eight) added to a row's scalar rest: its exact sum of codes times q (dot) with
// the zero point taken off as z * (sum of q over the group), scaled; UINT4_MIN: plus its min times that sum. Shared
// by the batch-1 kernel and the many-row one (gemv_quant_avx2_lanes.cpp) so that both round alike.
template <int F>
__attribute__((target("avx2,fma,f16c")))
inline float add_left_over_group(float rest, int32_t dot, int32_t gq, const at::Half* sr, const uint8_t* zr,
                                 const at::Half* mr, int64_t g) {
  rest += _cvtsh_ss(sr[g].x) * static_cast<float>(dot - zero_of<F>(zr, g) * gq);
  if constexpr (HAS_MIN<F>) rest += min_of<F>(mr, g) * static_cast<float>(gq);
  return rest;
}

}  // namespace qgemv
