// The AVX2 kernels of the quantized GEMV (isa 1 and 2): x rounded to int16 in k order (NATURAL) met with codes
// widened to int16 in vpmaddwd sums, for any batch and group (groups of 32 or 64: eight groups reduced together, each
// row of x on its own). The kernels that read 4-bit codes as nibbles and 8-bit codes as bytes in place are in
// gemv_quant_avx2_m1.cpp. Each prefetches its weight stream (simd.h). The math and the layouts are in gemv_quant.cpp's
// header, the shared pieces in gemv_quant.h, the measurements that chose them in docs/performance.md.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv_quant.h"
#include "gemv_quant_avx2.h"
#include "simd.h"

namespace qgemv {

namespace {

// one weight row n against MB rows of x: per group, exact int32 sums of (code - zero) * q (flushed to fp32
// every FLUSH k so they cannot overflow), then scaled by the group's scale in fp32 (UINT4_MIN: plus the group's
// min times its sum of q, from x's block sums)
template <int F, int MB>
__attribute__((target("avx2,fma,f16c")))
void row_avx2(const Act16& a, int64_t m0, const QuantView& w, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  const int16_t* q[MB];
  __m256 total[MB];
  float min_terms[MB] = {};   // UINT4_MIN: sum over groups of m_g * (sum of q over the group)
  for (int m = 0; m < MB; ++m) q[m] = a.q.data() + (m0 + m) * a.padded, total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t k0 = g * G;
    if constexpr (HAS_MIN<F>) {   // 4-bit: G is a multiple of 32
      const float mn = _cvtsh_ss(w.mins[n * w.groups + g].x);   // F16C: at::Half's own conversion is software
      const int64_t nb = a.padded / BLOCK;
      for (int m = 0; m < MB; ++m) {
        int64_t gq = 0;
        for (int64_t b = k0 / BLOCK; b < (k0 + G) / BLOCK; ++b) gq += a.block_sum[(m0 + m) * nb + b];
        min_terms[m] += mn * static_cast<float>(gq);
      }
    }
    const __m256i zero = _mm256_set1_epi16(static_cast<int16_t>(zero_of<F>(zr, g)));
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(sr[g].x));
    for (int64_t c0 = k0; c0 < k0 + G32; c0 += FLUSH) {
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
      const int64_t c1 = std::min(c0 + FLUSH, k0 + G32);
      for (int64_t k = c0; k < c1; k += BLOCK) {
        if constexpr (CODE_BITS<F> == 8) {   // 4-bit codes: no prefetch (gemv_quant.cpp's header)
          if (k % 64 == 0) simd::prefetch_stream(wr + k);
        }
        __m256i lo, hi;
        codes16<F>(wr, k, zero, &lo, &hi);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(lo, _mm256_loadu_si256(
                                                                  reinterpret_cast<const __m256i*>(q[m] + k))));
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(hi, _mm256_loadu_si256(
                                                                  reinterpret_cast<const __m256i*>(q[m] + k + 16))));
        }
      }
      for (int m = 0; m < MB; ++m) total[m] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(acc[m]), total[m]);
    }
    if constexpr (F == INT8 || F == UINT8) {   // per-channel 8-bit weights: K need not be a multiple of 32
      if (G32 < G) {
        const int z = zero_of<F>(zr, g);
        for (int m = 0; m < MB; ++m) {
          int32_t dot = 0;
          for (int64_t k = k0 + G32; k < k0 + G; ++k) dot += (code_at<F>(wr, k) - z) * q[m][k];
          total[m] = _mm256_add_ps(total[m], _mm256_setr_ps(_cvtsh_ss(sr[g].x) * static_cast<float>(dot), 0, 0, 0,
                                                            0, 0, 0, 0));
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (HAS_MIN<F>) y[(m0 + m) * N + n] = a.d[m0 + m] * (simd::hsum8(total[m]) + min_terms[m]);
    else y[(m0 + m) * N + n] = a.d[m0 + m] * simd::hsum8(total[m]);
  }
}

// Row m of x against weight row n, for small groups (G = 32 * BPG, BPG = 1 or 2): the
// per-group work of row_avx2 (widen a scale, broadcast it, convert, one FMA) costs as much as a block of 32
// codes at G = 32, so eight groups' int32 partials are reduced together (a horizontal-add tree puts group j's
// sum in lane j), their zero points are taken off as z_g * sum(q over the group) in int32, and one FMA applies
// eight scales. Larger groups stay on row_avx2, whose per-group work is spread over 4+ blocks (a generic loop
// over a group's blocks here was far slower).
template <int F, int BPG>
__attribute__((target("avx2,fma,f16c")))
void row_grouped_m1_avx2(const Act16& a, int64_t m, const QuantView& w, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const at::Half* mr = w.mins ? w.mins + n * w.groups : nullptr;
  const int16_t* q = a.q.data() + m * a.padded;
  constexpr int64_t G = BPG * BLOCK;
  const int32_t* qsum = a.block_sum.data() + m * a.padded / BLOCK;
  const __m256i no_zero = _mm256_setzero_si256();
  __m256 total = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) {
    __m256i p[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (((g + j) * G * CODE_BITS<F> / 8) % 64 == 0) simd::prefetch_stream(wr + (g + j) * G * CODE_BITS<F> / 8);
      p[j] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int b = 0; b < BPG; ++b) {
        const int64_t k = (g + j) * G + b * BLOCK;
        __m256i lo, hi;
        codes16<F>(wr, k, no_zero, &lo, &hi);
        p[j] = _mm256_add_epi32(p[j], _mm256_madd_epi16(lo, _mm256_loadu_si256(
                                                              reinterpret_cast<const __m256i*>(q + k))));
        p[j] = _mm256_add_epi32(p[j], _mm256_madd_epi16(hi, _mm256_loadu_si256(
                                                              reinterpret_cast<const __m256i*>(q + k + 16))));
      }
    }
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    const __m256i sums = eight_in_order(s0, s1);
    total = add_eight_groups<F>(sums, group_sums_of_blocks<BPG>(qsum, g), zr, sr, g, total, mr);
  }
  float rest = 0.f;
  for (; g < w.groups; ++g) {   // the last groups when there are not eight
    int32_t dot = 0, gq = 0;
    for (int64_t k = g * G; k < (g + 1) * G; ++k) dot += (code_at<F>(wr, k) - zero_of<F>(zr, g)) * q[k], gq += q[k];
    rest += _cvtsh_ss(sr[g].x) * static_cast<float>(dot);
    if constexpr (HAS_MIN<F>) rest += min_of<F>(mr, g) * static_cast<float>(gq);
  }
  y[m * N + n] = a.d[m] * (simd::hsum8(total) + rest);
}

}  // namespace

template <int F>
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if ((w.group == BLOCK || w.group == 2 * BLOCK) && w.groups > 1) {   // the batch-1 kernel for every row of x
    rows_each_alone(w, M, n0, n1, [&](int64_t m, int64_t n) {
      if (w.group == BLOCK) row_grouped_m1_avx2<F, 1>(a, m, w, n, y, N);
      else row_grouped_m1_avx2<F, 2>(a, m, w, n, y, N);
    });
    return;
  }
  if (M <= MR) {
    for (int64_t n = n0; n < n1; ++n) {
      switch (M) {
        case 1: row_avx2<F, 1>(a, 0, w, n, y, N); break;
        case 2: row_avx2<F, 2>(a, 0, w, n, y, N); break;
        case 3: row_avx2<F, 3>(a, 0, w, n, y, N); break;
        default: row_avx2<F, 4>(a, 0, w, n, y, N); break;
      }
    }
    return;
  }
  // every (weight row, row of x) pair is computed alike whatever MB, so a row's result does not depend on the batch
  tiled_rows(w, M, n0, n1, [&](int64_t m, int64_t mb, int64_t n) {   // gemv_quant.h
    switch (mb) {
      case 1: row_avx2<F, 1>(a, m, w, n, y, N); break;
      case 2: row_avx2<F, 2>(a, m, w, n, y, N); break;
      case 3: row_avx2<F, 3>(a, m, w, n, y, N); break;
      default: row_avx2<F, 4>(a, m, w, n, y, N); break;
    }
  });
}

#define INSTANTIATE(F) \
  template void rows_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, int64_t);
INSTANTIATE(INT8)
INSTANTIATE(UINT8)
INSTANTIATE(INT4)
INSTANTIATE(UINT4)
INSTANTIATE(UINT4_MIN)
#undef INSTANTIATE

}  // namespace qgemv
