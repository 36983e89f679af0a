// The AVX2 quantized GEMV's batch-1 kernels that read the codes in place: NIBBLES16 (4-bit codes in groups of 32, 64
// or 128 read as words, their nibbles isolated with a shift and a mask, against int16 x; NIBBLES8: the same with
// activate_quant's int8 x, in vpmaddubsw) and BYTES8 (8-bit codes against int8 x). Each prefetches its weight stream
// (simd.h). The math and the layouts are in gemv_quant.cpp's header, the pieces shared with gemv_quant_avx2.cpp in
// gemv_quant_avx2.h, the measurements that chose them in docs/performance.md.
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

// One row of x (batch-1 decode) against weight row n, 4-bit codes in groups of G = 32 * BPG (BPG = 1, 2 or 4),
// x in the NIBBLES16 layout: 32 bytes of codes are loaded as 16 words and each of a word's four nibbles is
// isolated with a shift and a mask into a vector that meets x in one vpmaddwd: about 3.5 instructions per 16
// codes where row_grouped_m1_avx2 widens bytes to words (5). A chunk's int32 partials hold block 2c in lanes
// 0-3 and block 2c + 1 in lanes 4-7; eight groups are reduced together as there.
__attribute__((target("avx2,fma,f16c")))
inline __m256i chunk_avx2(const uint8_t* codes, const int16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i m4 = _mm256_set1_epi16(0x000F);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  const __m256i s0 = _mm256_madd_epi16(_mm256_and_si256(w, m4), _mm256_loadu_si256(xv));
  const __m256i s1 = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), _mm256_loadu_si256(xv + 1));
  const __m256i s2 = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 8), m4), _mm256_loadu_si256(xv + 2));
  const __m256i s3 = _mm256_madd_epi16(_mm256_srli_epi16(w, 12), _mm256_loadu_si256(xv + 3));
  return _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
}

// The same chunk for activate_quant's int8 x (NIBBLES8), left in int16: the codes' low and high nibbles, as
// bytes, meet x in vpmaddubsw (codes unsigned, x signed: a pair sums to at most 2 * 15 * 127), and the two
// halves are added (lane sums at most 7620). llama.cpp's q4_0 . q8_0 dot product rests on the same instruction.
__attribute__((target("avx2,fma,f16c")))
inline __m256i pairs_a8(__m256i w, const int8_t* x) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(w, m4), _mm256_loadu_si256(xv));
  const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), _mm256_loadu_si256(xv + 1));
  return _mm256_add_epi16(lo, hi);
}

__attribute__((target("avx2,fma,f16c")))
inline __m256i chunk_pairs_a8(const uint8_t* codes, const int8_t* x) {
  return pairs_a8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), x);
}

// one chunk with int8 x as int32 partials, lanes as chunk_avx2's above
__attribute__((target("avx2,fma,f16c")))
inline __m256i chunk_avx2(const uint8_t* codes, const int8_t* x) {
  return _mm256_madd_epi16(chunk_pairs_a8(codes, x), _mm256_set1_epi16(1));
}

// Four consecutive chunks (128 bytes of codes, 256 k) reduced to one vector: in each 128-bit half, lane c holds
// chunk c's sum over that half's block (half 0: the chunk's first block of 32, half 1: its second).
__attribute__((target("avx2,fma,f16c")))
inline __m256i four_chunks(const uint8_t* codes, const int16_t* x) {
  const __m256i a = chunk_avx2(codes, x), b = chunk_avx2(codes + 32, x + 64);
  const __m256i c = chunk_avx2(codes + 64, x + 128), d = chunk_avx2(codes + 96, x + 192);
  return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}

// With int8 x the reduction stays in int16 until the end (lane sums at most 4 * 7620 < 32767), then one
// vpmaddwd with ones widens it: 9 multiplies per 256 k where widening each chunk takes 12. The 256-bit
// multiplies issue at one per 2 cycles on the Zen 3-class AVX2 VM, so they are what bounds this kernel.
__attribute__((target("avx2,fma,f16c")))
inline __m256i four_chunks(const uint8_t* codes, const int8_t* x) {
  const __m256i a = chunk_pairs_a8(codes, x), b = chunk_pairs_a8(codes + 32, x + 64);
  const __m256i c = chunk_pairs_a8(codes + 64, x + 128), d = chunk_pairs_a8(codes + 96, x + 192);
  return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d)),
                           _mm256_set1_epi16(1));
}

// Two groups of 128 (four chunks each: 128 bytes of codes, 256 k) as int32 [a a b b | a a b b]: each group's
// chunks are added before any horizontal add (int8 x: in int16, lane sums at most 2 * 7620), so a pair of
// groups takes one level of the tree where four_chunks takes two per four chunks.
__attribute__((target("avx2,fma,f16c")))
inline __m256i two_groups128(const uint8_t* codes, const int16_t* x) {
  const __m256i a = _mm256_add_epi32(chunk_avx2(codes, x), chunk_avx2(codes + 32, x + 64));
  const __m256i b = _mm256_add_epi32(chunk_avx2(codes + 64, x + 128), chunk_avx2(codes + 96, x + 192));
  return _mm256_hadd_epi32(a, b);
}

__attribute__((target("avx2,fma,f16c")))
inline __m256i two_groups128(const uint8_t* codes, const int8_t* x) {
  const __m256i a = _mm256_add_epi16(chunk_pairs_a8(codes, x), chunk_pairs_a8(codes + 32, x + 64));
  const __m256i b = _mm256_add_epi16(chunk_pairs_a8(codes + 64, x + 128), chunk_pairs_a8(codes + 96, x + 192));
  return _mm256_madd_epi16(_mm256_hadd_epi16(a, b), _mm256_set1_epi16(1));
}

// 16 bytes at lo and 16 at hi as one vector
__attribute__((target("avx2,fma,f16c")))
inline __m256i halves(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

// Two groups of 64 (32 bytes of codes each) with NIBBLES8's paired x (gemv_quant.h): one vector holds both groups'
// first blocks (its halves loaded separately), another their second blocks, and the two are added in int16 (lane
// sums at most 2 * 7620): [g .. | g + 1 ..], so, as for groups of 128, a pair of groups takes one level of the tree.
// (Groups of 128 are not paired this way: there it did not pay.)
__attribute__((target("avx2,fma,f16c")))
inline __m256i two_groups64(const uint8_t* codes, const int8_t* x) {
  return _mm256_add_epi16(pairs_a8(halves(codes, codes + 32), x), pairs_a8(halves(codes + 16, codes + 48), x + 64));
}

// Row m of x against weight row n, 4-bit codes in groups of G = 32 * BPG (BPG = 1, 2 or 4), x in the NIBBLES16
// layout (X = int16_t) or NIBBLES8 (X = int8_t: activate_quant). Groups of 32 stay in the lane order four_chunks
// leaves them in (add_eight_groups' LANE_ORDER) instead of a vpermd on their sums (one per 4 cycles
// on the AVX2 VM). One weight row per step and no prefetch of the scales' stream: the alternatives did not pay
// streaming from memory (docs/performance.md, "Choices in the code").
template <int F, int BPG, typename X>
__attribute__((target("avx2,fma,f16c")))
void row_nibbles_m1_avx2(const Act16& a, const X* rows_q, const QuantView& w, int64_t m, int64_t n, float* y,
                         int64_t N) {
  const int64_t nb = a.padded / BLOCK;
  const X* q = rows_q + m * a.padded;
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const at::Half* mr = w.mins ? w.mins + n * w.groups : nullptr;   // UINT4_MIN
  const int32_t* qsum = a.block_sum.data() + m * nb;
  const int32_t* gsum = a.group_sum.data() + m * w.groups;   // groups of 64 and 128
  const int32_t* qsum_lanes = a.block_sum_lanes.data() + m * nb;
  constexpr int64_t G = BPG * BLOCK;
  __m256 total = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) {   // 128 (G = 32) or 256 bytes of codes a step: a prefetch per 64
    for (int64_t b = 0; b < G * 4; b += 64) simd::prefetch_stream(wr + g * G / 2 + b);
    if constexpr (BPG == 1) {   // 4 chunks: lanes [g0 g2 g4 g6 | g1 g3 g5 g7], left in that order
      const __m256i group_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qsum_lanes + g));
      total = add_eight_groups<F, true>(four_chunks(wr + g * G / 2, q + g * G), group_q, zr, sr, g, total, mr);
      continue;
    }
    if constexpr (BPG == 2 && std::is_same_v<X, int8_t>) {   // pairs of groups: [g g+2 g+4 g+6 | g+1 g+3 ...]
      const uint8_t* c = wr + g * G / 2;
      const X* x = q + g * G;
      const __m256i ones = _mm256_set1_epi16(1);
      const __m256i lo = _mm256_madd_epi16(_mm256_hadd_epi16(two_groups64(c, x), two_groups64(c + 64, x + 128)), ones);
      const __m256i hi = _mm256_madd_epi16(_mm256_hadd_epi16(two_groups64(c + 128, x + 256),
                                                             two_groups64(c + 192, x + 384)), ones);
      const __m256i group_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gsum + g));   // in that order
      total = add_eight_groups<F, true>(_mm256_hadd_epi32(lo, hi), group_q, zr, sr, g, total, mr);
      continue;
    }
    __m256i sums;
    if constexpr (BPG == 4) {   // pairs of groups, then [g .. g+3 | g .. g+3] (each half's partials) twice
      const uint8_t* c = wr + g * G / 2;
      const X* x = q + g * G;
      sums = eight_in_order(_mm256_hadd_epi32(two_groups128(c, x), two_groups128(c + 128, x + 256)),
                            _mm256_hadd_epi32(two_groups128(c + 256, x + 512), two_groups128(c + 384, x + 768)));
    } else {                    // a chunk per group: the halves of groups g .. g + 3 and of g + 4 .. g + 7
      sums = eight_in_order(four_chunks(wr + g * G / 2, q + g * G),
                            four_chunks(wr + (g + 4) * G / 2, q + (g + 4) * G));
    }
    total = add_eight_groups<F>(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gsum + g)), zr, sr, g,
                                total, mr);
  }
  float rest = 0.f;
  // the rest of the row's codes: their lines 2 KiB ahead asked for too (without this, with 12 groups of 128 a
  // third of the stream would go unprefetched)
  for (int64_t b = g * G / 2; b < w.groups * G / 2; b += 64) simd::prefetch_stream(wr + b);
  if constexpr (BPG == 4) {
    if (g + 4 <= w.groups) {   // four more groups of 128 (K = 1536: 12 groups), as above in 128-bit halves
      const __m256i parts = _mm256_hadd_epi32(two_groups128(wr + g * G / 2, q + g * G),   // [g .. g+3 | g .. g+3]
                                              two_groups128(wr + (g + 2) * G / 2, q + (g + 2) * G));
      __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(parts), _mm256_extracti128_si256(parts, 1));
      __m128 min_terms = _mm_setzero_ps();   // UINT4_MIN: the four groups' m_g * (sum of q over the group)
      if constexpr (HAS_MIN<F>) {
        const __m128i group_q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gsum + g));
        const __m128 mins = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mr + g)));
        min_terms = _mm_mul_ps(mins, _mm_cvtepi32_ps(group_q));
      } else if constexpr (F != INT8) {
        const __m128i group_q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gsum + g));
        if constexpr (F == INT4) {
          sums = _mm_sub_epi32(sums, _mm_slli_epi32(group_q, 3));
        } else {
          int32_t z4;
          std::memcpy(&z4, zr + g, 4);
          sums = _mm_sub_epi32(sums, _mm_mullo_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(z4)), group_q));
        }
      }
      const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sr + g)));
      __m128 part = _mm_mul_ps(scales, _mm_cvtepi32_ps(sums));
      if constexpr (HAS_MIN<F>) part = _mm_add_ps(part, min_terms);
      total = _mm256_add_ps(total, _mm256_zextps128_ps256(part));
      g += 4;
    }
  }
  // the last groups when there are not eight (or four): a chunk (two groups of 32) or a group at a time
  constexpr int64_t STEP = BPG == 1 ? 2 : 1, LANES = 8 / STEP;
  for (; g < w.groups; g += STEP) {
    alignas(32) int32_t lanes[8];
    __m256i part = chunk_avx2(wr + g * G / 2, q + g * G);   // groups g, g + 1 (G = 32) or g
    if constexpr (BPG == 4) part = _mm256_add_epi32(part, chunk_avx2(wr + g * G / 2 + 32, q + g * G + 64));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), part);
    for (int64_t h = 0; h < STEP; ++h) {
      int32_t dot = 0;
      for (int64_t l = 0; l < LANES; ++l) dot += lanes[h * LANES + l];
      const int32_t gq = BPG == 1 ? qsum[g + h] : gsum[g + h];   // (left-over groups: in order)
      rest = add_left_over_group<F>(rest, dot, gq, sr, zr, mr, g + h);
    }
  }
  y[m * N + n] = a.d[m] * (simd::hsum8(total) + rest);
}

template <int F, typename X>
void row_nibbles(const Act16& a, const X* q, const QuantView& w, int64_t m, int64_t n, float* y, int64_t N) {
  if (w.group == BLOCK) row_nibbles_m1_avx2<F, 1>(a, q, w, m, n, y, N);
  else if (w.group == 2 * BLOCK) row_nibbles_m1_avx2<F, 2>(a, q, w, m, n, y, N);
  else row_nibbles_m1_avx2<F, 4>(a, q, w, m, n, y, N);
}


// Row m of x (activate_quant's int8 x in k order: BYTES8) against 8-bit weight row n.
// vpmaddubsw multiplies unsigned by signed bytes: the codes' magnitudes meet x carrying the codes' signs
// (|c| * sign(x, c) = c * x; |-128| is 128 as an unsigned byte, and |x| <= 127 keeps a pair's sum within int16),
// llama.cpp's q8_0 . q8_0 arithmetic; uint8 codes are first made signed (c - 128, the zero point with them).
// Two multiplies per 32 codes where the int16 x of row_avx2 takes two and two widenings.
template <int F>
__attribute__((target("avx2,fma,f16c")))
void row_bytes8_m1_avx2(const Act16& a, const QuantView& w, int64_t m, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int8_t* q = a.q8.data() + m * a.padded;
  const int32_t* bsum = a.block_sum.data() + m * (a.padded / BLOCK);
  const int64_t G = w.group;
  const __m256i ones = _mm256_set1_epi16(1), half = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 total = _mm256_setzero_ps();
  float zero_terms = 0.f;   // uint8: sum over groups of scale * (z - 128) * (sum of q over the group)
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {
      if (k % 64 == 0) simd::prefetch_stream(wr + k);   // simd.h: why
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
      if constexpr (F == UINT8) c = _mm256_xor_si256(c, half);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c)),
                                                    ones));
    }
    const float s = _cvtsh_ss(sr[g].x);
    total = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(acc), total);
    if constexpr (F == UINT8) {
      int32_t gq = 0;
      for (int64_t b = g * G / BLOCK; b < (g + 1) * G / BLOCK; ++b) gq += bsum[b];
      zero_terms += s * static_cast<float>((zr[g] - 128) * gq);
    }
  }
  y[m * N + n] = a.d[m] * (simd::hsum8(total) - zero_terms);
}


// 32 int8 codes at c against 32 bytes of x at q: 8 int32 partial sums (lane l: positions 4l .. 4l + 3)
__attribute__((target("avx2,fma,f16c")))
inline __m256i bytes8_block_sums(const uint8_t* c, const int8_t* q, __m256i ones) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
}

// Row m of x (BYTES8) against INT8 weight row n in groups of 32 (GGUF's Q8_0): the same products as
// row_bytes8_m1_avx2, but each group's sum made exact first, eight groups at a time, in the lane order the many-row
// kernel keeps them in (lane j: group (0, 2, 4, 6, 1, 3, 5, 7)[j]; gemv_quant_avx2_bytes8.cpp), then scaled with one
// FMA; the groups after the runs of eight one at a time (add_left_over_group). The many-row kernel meets each pair
// with the same operations on the same values, so a row's result is the same bits in any batch.
__attribute__((target("avx2,fma,f16c")))
void row_bytes8_g32_m1_avx2(const Act16& a, const QuantView& w, int64_t m, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const int8_t* q = a.q8.data() + m * a.padded;
  const __m256i ones = _mm256_set1_epi16(1);
  const auto group_sums = [&](int64_t g) { return bytes8_block_sums(wr + g * BLOCK, q + g * BLOCK, ones); };
  __m256 total = _mm256_setzero_ps();
  const int64_t full = w.groups / 8;
  for (int64_t u = 0; u < full; ++u) {
    const int64_t g = 8 * u;
    for (int l = 0; l < 4; ++l) simd::prefetch_stream(wr + g * BLOCK + 64 * l);   // simd.h: why
    // groups 0, 2, 4, 6 into lanes 0-3, then 1, 3, 5, 7 into 4-7: each hadd pairs two groups' partials
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(group_sums(g), group_sums(g + 2)),
                                         _mm256_hadd_epi32(group_sums(g + 4), group_sums(g + 6)));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(group_sums(g + 1), group_sums(g + 3)),
                                         _mm256_hadd_epi32(group_sums(g + 5), group_sums(g + 7)));
    total = add_eight_groups<INT8, true>(eight_in_order(s0, s1), _mm256_setzero_si256(), nullptr, sr, g, total);
  }
  float rest = 0.f;
  for (int64_t g = 8 * full; g < w.groups; ++g) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), group_sums(g));
    int32_t dot = 0;
    for (int l = 0; l < 8; ++l) dot += lanes[l];
    rest = add_left_over_group<INT8>(rest, dot, 0, sr, nullptr, nullptr, g);
  }
  y[m * N + n] = a.d[m] * (simd::hsum8(total) + rest);
}


}  // namespace

template <int F>
void rows_nibbles_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N,
                       Layout layout) {
  if constexpr (FOUR_BIT<F>) {
    if (layout == NIBBLES8)
      rows_each_alone(w, M, n0, n1, [&](int64_t m, int64_t n) { row_nibbles<F>(a, a.q8.data(), w, m, n, y, N); });
    else
      rows_each_alone(w, M, n0, n1, [&](int64_t m, int64_t n) { row_nibbles<F>(a, a.q.data(), w, m, n, y, N); });
  }
}

template <int F>
void rows_bytes8_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if constexpr (F == INT8) {
    if (w.group == BLOCK) {
      rows_each_alone(w, M, n0, n1, [&](int64_t m, int64_t n) { row_bytes8_g32_m1_avx2(a, w, m, n, y, N); });
      return;
    }
  }
  if constexpr (F == INT8 || F == UINT8)
    rows_each_alone(w, M, n0, n1, [&](int64_t m, int64_t n) { row_bytes8_m1_avx2<F>(a, w, m, n, y, N); });
}

#define INSTANTIATE(F)                                                                                        \
  template void rows_nibbles_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, int64_t, \
                                     Layout);                                                                \
  template void rows_bytes8_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, int64_t);
INSTANTIATE(INT8)
INSTANTIATE(UINT8)
INSTANTIATE(INT4)
INSTANTIATE(UINT4)
INSTANTIATE(UINT4_MIN)
#undef INSTANTIATE

}  // namespace qgemv
