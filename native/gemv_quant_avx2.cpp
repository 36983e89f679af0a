// The AVX2 kernels of the quantized GEMV (isa 1 and 2): x rounded to int16 in k order (NATURAL) met with codes
// widened to int16 in vpmaddwd sums, for any batch and group; and at batch 1 with 4-bit codes in groups of 32,
// 64 or 128, the NIBBLES16 kernel, which reads the codes as words and isolates their nibbles in place (NIBBLES8: the
// same with activate_quant's int8 x, in vpmaddubsw), and 8-bit codes with int8 x, BYTES8. Each prefetches its
// weight stream (simd.h). The math, the layouts and the measurements that chose them are in gemv_quant.cpp's
// header; the shared pieces in gemv_quant.h.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv_quant.h"
#include "simd.h"

namespace qgemv {

namespace {

// one weight row n against MB rows of x: per group, exact int32 sums of (code - zero) * q (flushed to fp32
// every FLUSH k so they cannot overflow), then scaled by the group's scale in fp32
template <int F, int MB>
__attribute__((target("avx2,fma,f16c")))
void row_avx2(const Act16& a, int64_t m0, const QuantView& w, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  const int16_t* q[MB];
  __m256 total[MB];
  for (int m = 0; m < MB; ++m) q[m] = a.q.data() + (m0 + m) * a.padded, total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t k0 = g * G;
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
  for (int m = 0; m < MB; ++m) y[(m0 + m) * N + n] = a.d[m0 + m] * simd::hsum8(total[m]);
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

// Eight groups' exact sums (lane j: group g + j) added to a row's fp32 total: the zero points taken off as
// z_g * (sum of q over the group: group_q, lanes as sums'), then the groups' scales applied in one FMA.
// LANE_ORDER: lane j holds group g + (0, 2, 4, 6, 1, 3, 5, 7)[j], as the batch-1 NIBBLES kernel's reduction leaves
// groups of 32 and (int8 x) of 64; group_q is then in that order too (Act16::block_sum_lanes, Act16::group_sum) and
// the zero points and scales are shuffled to it (row_nibbles_m1_avx2 says why).
template <int F, bool LANE_ORDER = false>
__attribute__((target("avx2,fma,f16c")))
inline __m256 add_eight_groups(__m256i sums, __m256i group_q, const uint8_t* zr, const at::Half* sr, int64_t g,
                               __m256 total) {
  if constexpr (F == INT4) {   // zero point 8
    sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(group_q, 3));
  } else if constexpr (F != INT8) {
    __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zr + g));
    if constexpr (LANE_ORDER) z8 = _mm_shuffle_epi8(z8, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(z8), group_q));
  }
  __m128i scale_bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + g));
  if constexpr (LANE_ORDER)
    scale_bits = _mm_shuffle_epi8(scale_bits, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_fmadd_ps(_mm256_cvtph_ps(scale_bits), _mm256_cvtepi32_ps(sums), total);
}

// One row of x (batch-1 decode) against weight row n, for small groups (G = 32 * BPG, BPG = 1 or 2): the
// per-group work of row_avx2 (widen a scale, broadcast it, convert, one FMA) costs as much as a block of 32
// codes at G = 32, so eight groups' int32 partials are reduced together (a horizontal-add tree puts group j's
// sum in lane j), their zero points are taken off as z_g * sum(q over the group) in int32, and one FMA applies
// eight scales. Measured (2 threads, 0.5 B model's gate/up weights, same rounds): int4 g32 1.07x -> 1.8x of
// the bf16 GEMV. A generic loop over a group's blocks here (G >= 128) ran 7x slower than row_avx2: larger
// groups stay on row_avx2, whose per-group work is spread over 4+ blocks.
template <int F, int BPG>
__attribute__((target("avx2,fma,f16c")))
void row_grouped_m1_avx2(const Act16& a, int64_t m, const QuantView& w, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
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
    total = add_eight_groups<F>(sums, group_sums_of_blocks<BPG>(qsum, g), zr, sr, g, total);
  }
  float rest = 0.f;
  for (; g < w.groups; ++g) {   // the last groups when there are not eight
    int32_t dot = 0;
    for (int64_t k = g * G; k < (g + 1) * G; ++k) dot += (code_at<F>(wr, k) - zero_of<F>(zr, g)) * q[k];
    rest += _cvtsh_ss(sr[g].x) * static_cast<float>(dot);
  }
  y[m * N + n] = a.d[m] * (simd::hsum8(total) + rest);
}

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
// multiplies issue at one per 2 cycles on the Zen 3-class VM measured (vpmaddubsw 1.25 G/s at ~2.5 GHz), so
// they are what bounds this kernel.
__attribute__((target("avx2,fma,f16c")))
inline __m256i four_chunks(const uint8_t* codes, const int8_t* x) {
  const __m256i a = chunk_pairs_a8(codes, x), b = chunk_pairs_a8(codes + 32, x + 64);
  const __m256i c = chunk_pairs_a8(codes + 64, x + 128), d = chunk_pairs_a8(codes + 96, x + 192);
  return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d)),
                           _mm256_set1_epi16(1));
}

// Two groups of 128 (four chunks each: 128 bytes of codes, 256 k) as int32 [a a b b | a a b b]: each group's
// chunks are added before any horizontal add (int8 x: in int16, lane sums at most 2 * 7620), so a pair of
// groups takes one level of the tree where four_chunks takes two per four chunks. The 0.5 B model's GEMV chain
// with int8 x (AVX2 VM, 2 threads, 25 interleaved rounds, twice): 1.16x as fast as reducing each chunk alone.
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
// The 0.5 B model's GEMV chain (AVX2 VM, 2 threads, 25 interleaved rounds): int4 g64 1.075x and 1.077x, uint4 g64
// 1.046x as fast as four_chunks on one group per chunk. (Groups of 128 paired the same way ran 0.97-0.99x.)
__attribute__((target("avx2,fma,f16c")))
inline __m256i two_groups64(const uint8_t* codes, const int8_t* x) {
  return _mm256_add_epi16(pairs_a8(halves(codes, codes + 32), x), pairs_a8(halves(codes + 16, codes + 48), x + 64));
}

// One row of x (batch-1 decode) against weight row n, 4-bit codes in groups of G = 32 * BPG (BPG = 1, 2 or 4),
// x in the NIBBLES16 layout (X = int16_t) or NIBBLES8 (X = int8_t: activate_quant). Groups of 32 stay in the lane
// order four_chunks leaves them in (add_eight_groups' LANE_ORDER) instead of a vpermd on their sums (one per 4 cycles
// on the AVX2 VM): ~7% faster in cache on one thread there; streaming the 0.5 B model's GEMV chain (2 threads, same
// rounds) int4 g32 1.00x, uint4 g32 1.07x of the permuting version. Tried and left: two weight rows
// sharing each load of x ran 1.3x faster in cache but 0.83x (g32) / 0.95x (g64) as fast streaming the 0.5 B
// model's GEMV chain on the AVX2 VM (same rounds); prefetching the scales' stream as well changed nothing (1.007x,
// 0.985x).
template <int F, int BPG, typename X>
__attribute__((target("avx2,fma,f16c")))
void row_nibbles_m1_avx2(const Act16& a, const X* q, const QuantView& w, int64_t n, float* y) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int32_t* qsum = a.block_sum.data();
  const int32_t* gsum = a.group_sum.data();   // groups of 64 and 128
  constexpr int64_t G = BPG * BLOCK;
  __m256 total = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) {   // 128 (G = 32) or 256 bytes of codes a step: a prefetch per 64
    for (int64_t b = 0; b < G * 4; b += 64) simd::prefetch_stream(wr + g * G / 2 + b);
    if constexpr (BPG == 1) {   // 4 chunks: lanes [g0 g2 g4 g6 | g1 g3 g5 g7], left in that order
      const __m256i group_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block_sum_lanes.data() + g));
      total = add_eight_groups<F, true>(four_chunks(wr + g * G / 2, q + g * G), group_q, zr, sr, g, total);
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
      total = add_eight_groups<F, true>(_mm256_hadd_epi32(lo, hi), group_q, zr, sr, g, total);
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
                                total);
  }
  float rest = 0.f;
  // the rest of the row's codes: their lines 2 KiB ahead asked for too (without this, with 12 groups of 128 a
  // third of the stream went unprefetched: 19.4 against 25.7 G codes/s for groups of 64 on the AVX2 VM)
  for (int64_t b = g * G / 2; b < w.groups * G / 2; b += 64) simd::prefetch_stream(wr + b);
  if constexpr (BPG == 4) {
    if (g + 4 <= w.groups) {   // four more groups of 128 (K = 1536: 12 groups), as above in 128-bit halves
      const __m256i parts = _mm256_hadd_epi32(two_groups128(wr + g * G / 2, q + g * G),   // [g .. g+3 | g .. g+3]
                                              two_groups128(wr + (g + 2) * G / 2, q + (g + 2) * G));
      __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(parts), _mm256_extracti128_si256(parts, 1));
      if constexpr (F != INT8) {
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
      total = _mm256_add_ps(total, _mm256_zextps128_ps256(_mm_mul_ps(scales, _mm_cvtepi32_ps(sums))));
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
      rest += _cvtsh_ss(sr[g + h].x) * static_cast<float>(dot - zero_of<F>(zr, g + h) * gq);
    }
  }
  y[n] = a.d[0] * (simd::hsum8(total) + rest);
}

template <int F, typename X>
void rows_nibbles_m1(const Act16& a, const X* q, const QuantView& w, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    if (w.group == BLOCK) row_nibbles_m1_avx2<F, 1>(a, q, w, n, y);
    else if (w.group == 2 * BLOCK) row_nibbles_m1_avx2<F, 2>(a, q, w, n, y);
    else row_nibbles_m1_avx2<F, 4>(a, q, w, n, y);
  }
}

// One row of x (batch-1 decode, activate_quant's int8 x in k order: BYTES8) against 8-bit weight row n.
// vpmaddubsw multiplies unsigned by signed bytes: the codes' magnitudes meet x carrying the codes' signs
// (|c| * sign(x, c) = c * x; |-128| is 128 as an unsigned byte, and |x| <= 127 keeps a pair's sum within int16),
// llama.cpp's q8_0 . q8_0 arithmetic; uint8 codes are first made signed (c - 128, the zero point with them).
// Two multiplies per 32 codes where the int16 x of row_avx2 takes two and two widenings. Measured on the Zen
// 3-class VM (standalone loops, 2 threads, a 200 MB stream): 20.2-21.2 G codes/s against 18.6 for the int16 kernel
// (both with the software prefetch); in L1 16 against 14 G/s on one thread.
template <int F>
__attribute__((target("avx2,fma,f16c")))
void row_bytes8_m1_avx2(const Act16& a, const QuantView& w, int64_t n, float* y) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int8_t* q = a.q8.data();
  const int32_t* bsum = a.block_sum.data();
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
  y[n] = a.d[0] * (simd::hsum8(total) - zero_terms);
}

}  // namespace

template <int F>
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if (M == 1 && (w.group == BLOCK || w.group == 2 * BLOCK) && w.groups > 1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (w.group == BLOCK) row_grouped_m1_avx2<F, 1>(a, 0, w, n, y, N);
      else row_grouped_m1_avx2<F, 2>(a, 0, w, n, y, N);
    }
    return;
  }
  for (int64_t m = 0; m < M; m += MR) {
    for (int64_t n = n0; n < n1; ++n) {
      switch (std::min(MR, M - m)) {
        case 1: row_avx2<F, 1>(a, m, w, n, y, N); break;
        case 2: row_avx2<F, 2>(a, m, w, n, y, N); break;
        case 3: row_avx2<F, 3>(a, m, w, n, y, N); break;
        default: row_avx2<F, 4>(a, m, w, n, y, N); break;
      }
    }
  }
}

template <int F>
void rows_nibbles_avx2(const Act16& a, const QuantView& w, int64_t n0, int64_t n1, float* y, Layout layout) {
  if constexpr (F == INT4 || F == UINT4) {
    if (layout == NIBBLES8) rows_nibbles_m1<F>(a, a.q8.data(), w, n0, n1, y);
    else rows_nibbles_m1<F>(a, a.q.data(), w, n0, n1, y);
  }
}

template <int F>
void rows_bytes8_avx2(const Act16& a, const QuantView& w, int64_t n0, int64_t n1, float* y) {
  if constexpr (F == INT8 || F == UINT8)
    for (int64_t n = n0; n < n1; ++n) row_bytes8_m1_avx2<F>(a, w, n, y);
}

#define INSTANTIATE(F)                                                                                          \
  template void rows_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, int64_t); \
  template void rows_nibbles_avx2<F>(const Act16&, const QuantView&, int64_t, int64_t, float*, Layout);   \
  template void rows_bytes8_avx2<F>(const Act16&, const QuantView&, int64_t, int64_t, float*);
INSTANTIATE(INT8)
INSTANTIATE(UINT8)
INSTANTIATE(INT4)
INSTANTIATE(UINT4)
#undef INSTANTIATE

}  // namespace qgemv
