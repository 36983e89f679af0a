// Quantized linear for decode: y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias), and the dequantization
// of a whole weight for prefill (then ATen's GEMM runs on it).
//
// Layout (allspark_server/quant/formats.py writes it; that file's `dequantize` is the reference):
//   qweight  int8 [N, K] (format 0, int8) | uint8 [N, K] (1, uint8) | uint8 [N, K/2] (2 int4, 3 uint4)
//   scales   fp16 [N, K/G]; zeros uint8 [N, K/G] for uint8/uint4 (int4's zero is 8, int8's 0)
//   4-bit: per block of 32 k, byte j holds k = j (low nibble) and k = 16 + j (high nibble).
//
// Math (weight-only, "A16W8 / A16W4"): each row of x is rounded to 16-bit fixed point, q = round(x * 32767 /
// absmax), d = absmax / 32767 (an element's rounding error is at most 1/65534 of the row's largest magnitude:
// for every element above 1/128 of it, less than bf16's own rounding of that element, 1/512). The weight codes
// minus their zero point are widened to int16 and met with q in exact integer multiply-adds (vpmaddwd), summed
// in int32 over each group, then in fp32:   y = d * sum_g s_g * sum_{k in g} (c_k - z_g) q_k
// ops.linear_reference rounds x the same way, then dequantizes and multiplies; the kernel equals it up to fp32
// rounding. One rounding into the activation dtype at the end, bias included. compute_method activate_quant
// ("A8W8", QuantWeight::act_bits = 8) rounds x to int8 instead, q = round(x * 127 / absmax); nothing else changes.
//
// Why not fp32 FMAs on codes widened to fp32: measured on a Zen 3-class AVX2 core with the weights in L2, that
// ran at ~4 G weights/s (int8) and ~2.8 G (4-bit) per core, and over a 0.5 B model's gate/up weights (2
// threads) 4-bit decoded 0.84x as fast as our bf16 GEMV: the widening instructions, not the memory, were the
// limit. The int16 path needs about half the instructions per weight and no fp32 work inside a group.
// (Rounding x to int8 instead, llama.cpp's q8_0 . q8_0, needs a few instructions less but adds a 1/254
// activation error.)
//
// Software prefetch: none in the AVX-512 kernel (on Zen 4 a prefetch 1 KiB ahead in the row halved its speed
// when streaming from memory: int8 per channel 1.33x -> 2.03x of the bf16 GEMV without it, same rounds). The
// AVX2 kernels prefetch 2 KiB ahead (simd.h): on the Zen 3-class AVX2 VM the hardware prefetchers fall behind,
// and the GEMV chain of the 0.5 B model (2 threads) went 48.1 -> 39.3-45.2 ms (bf16), 24.1 -> 19.8 ms (int8 with
// activate_quant, BYTES8 below), 20.6 -> 14.0-15.0 ms (int4 g64 a8). The 16-bit row_avx2 kernel prefetches 8-bit
// codes only: with 4-bit codes it is bound by its instructions, and the prefetch made int4 g128 26 -> 32 ms
// (groups of 128 take NIBBLES16 / 8 since: GEMV chain 1.48x -> 1.77x of bf16's, 1.45x -> 2.24x with int8 x).
//
// ISA (chosen by ops.py): 3 AVX-512 VNNI (gemv_quant_avx512.cpp: vpdpwssd, x laid out to match the
// codes), 1 and 2 AVX2+FMA+F16C (gemv_quant_avx2.cpp; 2 = AVX-512 without VNNI: its dequantization is AVX-512),
// 0 portable C++; the same rounding of x everywhere, so every level equals ops.linear_reference up to fp32
// summation order. The weight streams row by row; each thread owns a contiguous block of rows, up to 4 rows of x
// share each block of codes. At batch 1, 4-bit codes in groups of 32, 64 or 128 take the AVX2 NIBBLES16 kernel (codes
// read as words, nibbles isolated in place, x reordered to match); with activate_quant's int8 x, NIBBLES8 (the
// nibbles as bytes, vpmaddubsw; the chain of the 0.5 B model's GEMVs, 2 threads: int4 g32 2.2x -> 2.9-3.0x of the
// bf16 GEMV, since the AVX2 VM's 256-bit multiplies, which bound the 16-bit kernel, issue at one per 2 cycles);
// 8-bit codes with int8 x take BYTES8 (vpmaddubsw on the codes' magnitudes and x signed like the codes).
// This file: rounding x, the portable kernel, the dequantization and the entry points; what the three files share
// is in gemv_quant.h.
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_quant.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

using namespace qgemv;

inline float abs_max(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline float abs_max_avx512(const float* x, int64_t n) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - k)) - 1);
    // abs first: a NaN element is then skipped, as std::max skips it in abs_max
    amax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)), amax);
  }
  return _mm512_reduce_max_ps(amax);
}

__attribute__((target("avx2,fma,f16c")))
inline float abs_max_avx2(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)   // a NaN element is skipped, as in abs_max (max_ps returns its second operand)
    amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), amax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  return std::max(abs_max(lanes, 8), abs_max(x + k, n - k));
}

__attribute__((target("avx2,fma,f16c")))
void round_row_avx2(const float* x, int64_t n, float inv, int16_t* q) {
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), iv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
  for (; i < n; ++i) q[i] = static_cast<int16_t>(std::nearbyint(x[i] * inv));
}

// bf16 -> fp32 (exact: the bits moved up 16)
__attribute__((target("avx2,fma,f16c")))
void widen_bf16_avx2(const at::BFloat16* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, simd::load8(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

void widen_bf16(const at::BFloat16* x, int64_t n, float* out, int64_t isa) {
  if (isa >= 1) return widen_bf16_avx2(x, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// NIBBLES8 from x rounded in k order (|r| <= 127, zero padded to `padded`, a multiple of 64): per 64 k the runs of
// 16 in the order 0, 2, 1, 3 as bytes, and the sum of each block of 32
__attribute__((target("avx2,fma,f16c")))
void nibbles8_avx2(const int16_t* r, int64_t padded, int8_t* q8, int32_t* bsum) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c = 0; c < padded; c += CHUNK16) {
    const __m256i* v = reinterpret_cast<const __m256i*>(r + c);
    const __m256i r0 = _mm256_loadu_si256(v), r1 = _mm256_loadu_si256(v + 1);
    const __m256i r2 = _mm256_loadu_si256(v + 2), r3 = _mm256_loadu_si256(v + 3);
    // packs works per 128-bit half: [r0 lo 8, r2 lo 8 | r0 hi 8, r2 hi 8], put back as [r0 | r2]
    __m256i* out = reinterpret_cast<__m256i*>(q8 + c);
    _mm256_storeu_si256(out, _mm256_permute4x64_epi64(_mm256_packs_epi16(r0, r2), 0xD8));
    _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(_mm256_packs_epi16(r1, r3), 0xD8));
    // block c / 32: runs 0 and 1; block c / 32 + 1: runs 2 and 3
    const __m256i s01 = _mm256_madd_epi16(_mm256_add_epi16(r0, r1), ones);
    const __m256i s23 = _mm256_madd_epi16(_mm256_add_epi16(r2, r3), ones);
    const __m256i h = _mm256_hadd_epi32(s01, s23);        // [s01 pairs, s23 pairs | s01 pairs, s23 pairs]
    const __m256i quads = _mm256_hadd_epi32(h, h);         // lanes 0, 1 (and 4, 5): half sums of each block
    bsum[c / BLOCK] = _mm256_extract_epi32(quads, 0) + _mm256_extract_epi32(quads, 4);
    bsum[c / BLOCK + 1] = _mm256_extract_epi32(quads, 1) + _mm256_extract_epi32(quads, 5);
  }
}

// n sums in the lane order the batch-1 AVX2 kernel's reductions leave eight groups in: each full eight as 0, 2, 4,
// 6, 1, 3, 5, 7, a last partial eight as it is (the kernel's tail reads it in order); dst may be src
void to_lane_order(const int32_t* src, int64_t n, int32_t* dst) {
  constexpr int ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int32_t eight[8];
    for (int j = 0; j < 8; ++j) eight[j] = src[i + ORDER[j]];
    std::memcpy(dst + i, eight, sizeof(eight));
  }
  if (dst != src) std::memcpy(dst + i, src + i, (n - i) * sizeof(int32_t));
}

// NIBBLES8 with groups of 64 (gemv_quant.h): in each full eight groups, the runs of 16 bytes of each pair of groups
// interleaved
void pair_groups64(int8_t* q8, int64_t groups) {
  constexpr int RUN = 16;
  for (int64_t p = 0; p + 2 <= groups / 8 * 8; p += 2) {
    int8_t* pair = q8 + p * 2 * BLOCK;   // 128 bytes: group p's four runs, then p + 1's
    int8_t copy[4 * BLOCK];
    std::memcpy(copy, pair, sizeof(copy));
    for (int i = 0; i < 4; ++i) {         // out run 2i: p's run (0, 2, 1, 3)[i]; 2i + 1: p + 1's
      const int run = i == 1 ? 2 : i == 2 ? 1 : i;
      std::memcpy(pair + 2 * i * RUN, copy + run * RUN, RUN);
      std::memcpy(pair + (2 * i + 1) * RUN, copy + 4 * RUN + run * RUN, RUN);
    }
  }
}

// the same arithmetic on every ISA: one multiply by act_max / absmax (32767; 127 for activate_quant, whose q
// then fit int8 but are stored and multiplied as int16 all the same), round half to even (PAIRS / NIBBLES:
// only for the AVX-512 kernel, isa >= 3); `group`: the weight's group size (NIBBLES16 / NIBBLES8: group sums)
Act16 round_activations(const float* x, int64_t M, int64_t K, int64_t isa, float act_max, Layout layout, int64_t group) {
  Act16 a;
  const bool avx512 = layout == PAIRS || layout == NIBBLES;
  const bool nibbles = layout == NIBBLES16 || layout == NIBBLES8;
  const bool bytes = layout == NIBBLES8 || layout == BYTES8;   // q8 instead of q
  const int64_t unit = avx512 ? CHUNK : nibbles ? CHUNK16 : BLOCK;
  const int64_t nb = (K + unit - 1) / unit * unit / BLOCK;
  a.padded = nb * BLOCK;
  a.q.assign(bytes ? 0 : M * a.padded, 0);
  a.q8.assign(bytes ? M * a.padded : 0, 0);
  a.block_sum.assign(M * nb, 0);
  a.chunk_sum.assign(avx512 ? M * nb / 16 : 0, 0);
  a.block_sum_lanes.assign(nibbles ? M * nb : 0, 0);
  const int64_t per_group = nibbles && group > BLOCK ? group / BLOCK : 0, groups = per_group ? nb / per_group : 0;
  a.group_sum.assign(M * groups, 0);
  a.d.assign(M, 0.f);
  std::vector<int16_t> natural(nibbles || bytes ? a.padded : 0, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    const float amax = avx512 ? abs_max_avx512(xm, K) : isa >= 1 ? abs_max_avx2(xm, K) : abs_max(xm, K);
    const float inv = amax > 0.f ? act_max / amax : 0.f;
    a.d[m] = amax / act_max;
    int16_t* q = bytes ? nullptr : a.q.data() + m * a.padded;
    int32_t* bsum = a.block_sum.data() + m * nb;
    if (avx512) {
      round_row_avx512(xm, K, a.padded, inv, layout, q, bsum, a.chunk_sum.data() + m * nb / 16);
      continue;
    }
    int16_t* r = nibbles || bytes ? natural.data() : q;   // rounded in k order, then reordered / narrowed
    if (isa >= 1) round_row_avx2(xm, K, inv, r);
    else for (int64_t k = 0; k < K; ++k) r[k] = static_cast<int16_t>(std::nearbyint(xm[k] * inv));
    if (layout == NIBBLES8) {   // the block sums and the reordering (AVX2: run_linear picks NIBBLES8 for isa >= 1)
      nibbles8_avx2(r, a.padded, a.q8.data() + m * a.padded, bsum);
    } else {
      for (int64_t b = 0; b * BLOCK < K; ++b) {
        int32_t t = 0;
        for (int64_t k = b * BLOCK; k < std::min(K, (b + 1) * BLOCK); ++k) t += r[k];
        bsum[b] = t;
      }
    }
    if (groups) {
      int32_t* gsum = a.group_sum.data() + m * groups;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < per_group; ++b) gsum[g] += bsum[g * per_group + b];
      if (layout == NIBBLES8 && group == 2 * BLOCK) {
        pair_groups64(a.q8.data() + m * a.padded, groups);
        to_lane_order(gsum, groups, gsum);
      }
    }
    if (nibbles) to_lane_order(bsum, nb, a.block_sum_lanes.data() + m * nb);
    if (layout == NIBBLES16) {
      for (int64_t c = 0; c < a.padded; c += CHUNK16) {
        for (int64_t i = 0; i < 16; ++i) {   // word i: block b = i / 8, byte pair j = i % 8 (gemv_quant.h)
          const int64_t k = c + 32 * (i / 8) + 2 * (i % 8);
          q[c + i] = r[k], q[c + 16 + i] = r[k + 16], q[c + 32 + i] = r[k + 1], q[c + 48 + i] = r[k + 17];
        }
      }
    } else if (layout == BYTES8) {     // |r| <= 127 (act_max 127)
      int8_t* q8 = a.q8.data() + m * a.padded;
      for (int64_t k = 0; k < K; ++k) q8[k] = static_cast<int8_t>(r[k]);
    }
  }
  return a;
}

// ---- portable ---------------------------------------------------------------------------------
template <int F>
void rows_scalar(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* q = a.q.data() + m * a.padded;
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int z = zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g);
        float acc = 0.f;
        for (int64_t k0 = g * w.group; k0 < (g + 1) * w.group; k0 += FLUSH) {   // int32 never overflows
          int32_t dot = 0;
          for (int64_t k = k0; k < std::min(k0 + FLUSH, (g + 1) * w.group); ++k) dot += (code_at<F>(wr, k) - z) * q[k];
          acc += static_cast<float>(dot);
        }
        total += half_to_float(w.scales[n * w.groups + g]) * acc;
      }
      y[m * N + n] = a.d[m] * total;
    }
  }
}

template <int F>
void rows(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N,
          int64_t isa, Layout layout) {
  if (layout == NIBBLES16 || layout == NIBBLES8) rows_nibbles_avx2<F>(a, w, n0, n1, y, layout);
  else if (layout == BYTES8) rows_bytes8_avx2<F>(a, w, n0, n1, y);
  else if (layout != NATURAL) rows_avx512<F>(a, M, w, K, n0, n1, y, N);
  else if (isa >= 1) rows_avx2<F>(a, M, w, n0, n1, y, N);
  else rows_scalar<F>(a, M, w, n0, n1, y, N);
}

// fp32 vectors of codes, for the dequantization below
template <int F>
__attribute__((target("avx2,fma,f16c")))
inline void codes32(const uint8_t* row, int64_t k, __m256 v[4]) {
  __m256i lo, hi;
  codes16<F>(row, k, _mm256_setzero_si256(), &lo, &hi);
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo)));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi)));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1)));
}

// ---- dequantization (prefill) -------------------------------------------------------------------
template <int F, typename T>
__attribute__((target("avx2,fma,f16c")))
void dequantize_rows_avx2(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out) {
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = _cvtsh_ss(w.scales[n * w.groups + g].x);
      const float z = F == INT8 ? 0.f : F == INT4 ? 8.f : static_cast<float>(w.zeros[n * w.groups + g]);
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
      int64_t k = g * G;
      for (; k < g * G + G32; k += BLOCK) {
        __m256 v[4];
        codes32<F>(wr, k, v);
        for (int i = 0; i < 4; ++i) simd::store8(out + n * K + k + 8 * i, _mm256_mul_ps(_mm256_sub_ps(v[i], zv), sv));
      }
      for (; k < (g + 1) * G; ++k) out[n * K + k] = static_cast<T>((static_cast<float>(code_at<F>(wr, k)) - z) * s);
    }
  }
}

// the same per block on AVX-512 (any AVX-512 level): 16 codes widened straight to int32 lanes
template <int F, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
void dequantize_rows_avx512(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out) {
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = _cvtsh_ss(w.scales[n * w.groups + g].x);
      const float z = F == INT8 ? 0.f : F == INT4 ? 8.f : static_cast<float>(w.zeros[n * w.groups + g]);
      const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
      int64_t k = g * G;
      for (; k < g * G + G32; k += BLOCK) {
        __m512i v0, v1;
        if constexpr (F == INT4 || F == UINT4) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2)), nib = _mm_set1_epi8(0x0F);
          v0 = _mm512_cvtepu8_epi32(_mm_and_si128(b, nib));
          v1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
        } else {
          const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
          const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
          if constexpr (F == INT8) v0 = _mm512_cvtepi8_epi32(b0), v1 = _mm512_cvtepi8_epi32(b1);
          else v0 = _mm512_cvtepu8_epi32(b0), v1 = _mm512_cvtepu8_epi32(b1);
        }
        simd::store16(out + n * K + k, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v0), zv), sv));
        simd::store16(out + n * K + k + 16, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v1), zv), sv));
      }
      for (; k < (g + 1) * G; ++k) out[n * K + k] = static_cast<T>((static_cast<float>(code_at<F>(wr, k)) - z) * s);
    }
  }
}

template <int F, typename T>
void dequantize_rows(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out, int64_t isa) {
  if (isa >= 2) return dequantize_rows_avx512<F, T>(w, K, n0, n1, out);
  if (isa >= 1) return dequantize_rows_avx2<F, T>(w, K, n0, n1, out);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / w.group;
      const float z = zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g);
      out[n * K + k] = static_cast<T>((static_cast<float>(code_at<F>(wr, k)) - z) * half_to_float(w.scales[n * w.groups + g]));
    }
  }
}

#define DISPATCH_FORMAT(fmt, ...)                        \
  switch (fmt) {                                         \
    case INT8: { constexpr int F = INT8; __VA_ARGS__; break; }   \
    case UINT8: { constexpr int F = UINT8; __VA_ARGS__; break; } \
    case INT4: { constexpr int F = INT4; __VA_ARGS__; break; }   \
    default: { constexpr int F = UINT4; __VA_ARGS__; break; }    \
  }

template <typename O>
void run_linear(const float* x, int64_t M, int64_t K, const QuantView& w, const O* bias, O* out, int64_t isa) {
  const int64_t N = w.rows;
  const Layout layout = isa >= 3 && avx512_fits(w)                  ? (w.format >= INT4 ? NIBBLES : PAIRS)
                        : isa >= 1 && M == 1 && nibbles16_fits(w, K) ? (w.act_max == 127.f ? NIBBLES8 : NIBBLES16)
                        : isa >= 1 && M == 1 && w.act_max == 127.f && bytes8_fits(w, K) ? BYTES8
                                                                      : NATURAL;
  const Act16 a = round_activations(x, M, K, isa, w.act_max, layout, w.group);
  std::vector<float> scratch(std::is_same_v<O, float> ? 0 : M * N);
  float* y = std::is_same_v<O, float> ? reinterpret_cast<float*>(out) : scratch.data();
  const int64_t grain = allspark::weight_rows_grain(w.row_bytes);
  allspark::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    DISPATCH_FORMAT(w.format, rows<F>(a, M, w, K, n0, n1, y, N, isa, layout));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n)
        out[m * N + n] = static_cast<O>(y[m * N + n] + (bias ? static_cast<float>(bias[n]) : 0.f));
  });
}

}  // namespace

QuantView QuantWeight::view() const {
  QuantView v;
  v.codes = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  v.scales = scales.data_ptr<at::Half>();
  v.zeros = zeros ? zeros->data_ptr<uint8_t>() : nullptr;
  v.format = format;
  v.rows = qweight.size(0);
  v.row_bytes = qweight.size(1);
  v.groups = scales.size(1);
  v.group = in_features / v.groups;
  v.act_max = act_bits == 8 ? 127.f : ACT_MAX;
  return v;
}

void QuantWeight::check() const {
  TORCH_CHECK(format >= INT8 && format <= UINT4, "QuantWeight: unknown format ", format);
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "QuantWeight: act_bits must be 8 or 16, got ", act_bits);
  const bool four = format >= INT4;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == (format == INT8 ? at::kChar : at::kByte),
              "QuantWeight: qweight must be contiguous 2-D ", format == INT8 ? "int8" : "uint8");
  TORCH_CHECK(qweight.size(1) == (four ? in_features / 2 : in_features), "QuantWeight: qweight has ",
              qweight.size(1), " columns for ", in_features, " input features");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.size(0) == qweight.size(0) && scales.size(1) >= 1 && in_features % scales.size(1) == 0,
              "QuantWeight: scales must be fp16 [N, groups] with groups dividing K");
  const int64_t group = in_features / scales.size(1);
  TORCH_CHECK(!four || (in_features % BLOCK == 0 && (scales.size(1) == 1 || group % BLOCK == 0)),
              "QuantWeight: 4-bit weights need K and the group size to be multiples of 32");
  TORCH_CHECK(scales.size(1) == 1 || group % BLOCK == 0, "QuantWeight: group sizes are multiples of 32");
  const bool has_zeros = format == UINT8 || format == UINT4;
  TORCH_CHECK(has_zeros == zeros.has_value(), "QuantWeight: zeros are given exactly for uint8/uint4");
  if (zeros)
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "QuantWeight: zeros must be uint8 shaped like scales");
}

torch::Tensor linear_quant(torch::Tensor x, const QuantWeight& w, std::optional<torch::Tensor> bias, int64_t isa) {
  w.check();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_features, "linear_quant: x ", x.sizes(), " for K = ", w.in_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_quant: x fp32 or bf16");
  const QuantView v = w.view();
  const int64_t M = x.size(0), K = w.in_features, N = v.rows;
  if (bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                bias->scalar_type() == x.scalar_type(), "linear_quant: bias must be [N] in x's dtype");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  if (x.scalar_type() == at::kFloat) {
    run_linear<float>(xc.data_ptr<float>(), M, K, v, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                      isa);
  } else {
    // x in fp32 once, shared by every weight row: widened here, not by an ATen op (x.to(kFloat) took ~10 us of a
    // decode step's every GEMV on the AVX2 VM, its code cold after the weight stream)
    thread_local std::vector<float> widened;
    widened.resize(M * K);
    widen_bf16(xc.data_ptr<at::BFloat16>(), M * K, widened.data(), isa);
    run_linear<at::BFloat16>(widened.data(), M, K, v, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                             y.data_ptr<at::BFloat16>(), isa);
  }
  return y;
}

torch::Tensor dequantize_weight(const QuantWeight& w, at::ScalarType dtype, int64_t isa) {
  w.check();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_weight: fp32 or bf16 output");
  const QuantView v = w.view();
  const int64_t K = w.in_features;
  auto out = torch::empty({v.rows, K}, torch::TensorOptions().dtype(dtype));
  const int64_t grain = allspark::weight_rows_grain(v.row_bytes);
  allspark::parallel_for(0, v.rows, grain, [&](int64_t n0, int64_t n1) {
    if (dtype == at::kFloat) {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, float>(v, K, n0, n1, out.data_ptr<float>(), isa));
    } else {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, at::BFloat16>(v, K, n0, n1, out.data_ptr<at::BFloat16>(), isa));
    }
  });
  return out;
}

namespace {
// y = nearbyint(x * inv) * d for one row (the rounding of round_rows), y fp32 or bf16 (rounded to nearest even)
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void scale_row_avx512(const float* x, int64_t K, float inv, float d, T* y) {
  const __m512 iv = _mm512_set1_ps(inv), dv = _mm512_set1_ps(d);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), iv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    simd::store16(y + k, _mm512_mul_ps(q, dv));
  }
  for (; k < K; ++k) y[k] = static_cast<T>(std::nearbyint(x[k] * inv) * d);
}

template <typename T>
__attribute__((target("avx2,fma,f16c")))
void scale_row_avx2(const float* x, int64_t K, float inv, float d, T* y) {
  const __m256 iv = _mm256_set1_ps(inv), dv = _mm256_set1_ps(d);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    simd::store8(y + k, _mm256_mul_ps(q, dv));
  }
  for (; k < K; ++k) y[k] = static_cast<T>(std::nearbyint(x[k] * inv) * d);
}

template <typename X, typename T>
void round_rows_of(const X* x, int64_t M, int64_t K, float act_max, T* y, int64_t isa) {
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (4 * std::max<int64_t>(K, 1)));
  allspark::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> widened(std::is_same_v<X, float> ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm;
      if constexpr (std::is_same_v<X, float>) {
        xm = x + m * K;
      } else {
        widen_bf16(x + m * K, K, widened.data(), isa);
        xm = widened.data();
      }
      const float amax = isa >= 2 ? abs_max_avx512(xm, K) : isa >= 1 ? abs_max_avx2(xm, K) : abs_max(xm, K);
      const float inv = amax > 0.f ? act_max / amax : 0.f, d = amax / act_max;
      T* ym = y + m * K;
      if (isa >= 2) scale_row_avx512(xm, K, inv, d, ym);
      else if (isa >= 1) scale_row_avx2(xm, K, inv, d, ym);
      else for (int64_t k = 0; k < K; ++k) ym[k] = static_cast<T>(std::nearbyint(xm[k] * inv) * d);
    }
  });
}
}  // namespace

torch::Tensor round_rows(const torch::Tensor& x, double act_max, at::ScalarType dtype, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "round_rows: x must be 2-D, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "round_rows: x must be fp32 or bf16");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "round_rows: the result is fp32 or bf16");
  TORCH_CHECK(act_max > 0, "round_rows: act_max must be positive");
  const auto xc = x.contiguous();
  auto y = torch::empty(xc.sizes(), xc.options().dtype(dtype));
  const int64_t M = xc.size(0), K = xc.size(1);
  const float a = static_cast<float>(act_max);
  auto run = [&](auto* xp) {
    if (dtype == at::kFloat) round_rows_of(xp, M, K, a, y.data_ptr<float>(), isa);
    else round_rows_of(xp, M, K, a, y.data_ptr<at::BFloat16>(), isa);
  };
  if (xc.scalar_type() == at::kFloat) run(xc.data_ptr<float>());
  else run(xc.data_ptr<at::BFloat16>());
  return y;
}

namespace {
// AVX-512 bf16 (vdpbf16ps; AMX machines have it too): whether oneDNN's bf16 GEMM is fast here (ops.gemm_dtype)
bool bf16_dot_products() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
}  // namespace

torch::Tensor linear_widened(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b,
                             int64_t isa) {
  const auto* q = std::get_if<QuantWeight>(&w);
  if (q) q->check();
  const torch::Tensor dense = q ? torch::Tensor() : std::get<torch::Tensor>(w);
  const int64_t K = q ? q->in_features : dense.size(1), N = q ? q->qweight.size(0) : dense.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear_widened: x ", x.sizes(), " for a weight of K = ", K);
  const auto xf = x.to(torch::kFloat).contiguous();
  auto yt = torch::empty({N, x.size(0)}, xf.options());   // y^T: each tile fills a contiguous block of rows
  const int64_t tile = std::max<int64_t>(16, WIDEN_TILE_BYTES / (4 * std::max<int64_t>(K, 1)));
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nt = std::min(tile, N - n0);
    torch::Tensor wt;
    if (q) {
      const QuantWeight rows{q->qweight.narrow(0, n0, nt), q->scales.narrow(0, n0, nt),
                             q->zeros ? std::optional<torch::Tensor>(q->zeros->narrow(0, n0, nt)) : std::nullopt,
                             q->format, q->in_features, q->act_bits};
      wt = dequantize_weight(rows, at::kFloat, isa);
    } else {
      wt = dense.narrow(0, n0, nt).to(torch::kFloat);
    }
    auto out = yt.narrow(0, n0, nt);
    at::mm_out(out, wt, xf.t());
  }
  auto y = yt.t();
  if (b) y = y + b->to(torch::kFloat);
  return y.to(x.scalar_type()).contiguous();
}

torch::Tensor project(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b, int64_t isa,
                      int64_t native_rows) {
  if (const auto* q = std::get_if<QuantWeight>(&w)) {
    if (x.size(0) <= QUANT_NATIVE_MAX_ROWS) return linear_quant(x, *q, b, isa);
    // fp32 GEMM on the dequantized weight: without AVX-512 bf16 instructions oneDNN's bf16 GEMM is ~5x slower
    // (ops.gemm_dtype has the numbers); these are decode batches, small next to prefill GEMMs
    // activate_quant: x rounded as the GEMV would meet it
    const auto xf = q->act_bits == 8 ? round_rows(x, 127.0, at::kFloat, isa) : x.to(torch::kFloat);
    return linear_widened(xf, w, b, isa).to(x.scalar_type());
  }
  const auto& dense = std::get<torch::Tensor>(w);
  if (x.size(0) <= native_rows) return linear_small_m(x, dense, b, isa);
  if (x.scalar_type() == at::kBFloat16 && dense.scalar_type() == at::kBFloat16 && !bf16_dot_products())
    return linear_widened(x, w, b, isa);   // as ops.gemm_dtype decides for Python
  return at::linear(x, dense, b);
}
