// SIMD helpers shared by the kernels: AVX-512 16-lane and AVX2 8-lane loads of fp32 or bf16 rows (bf16 widened
// to fp32), 16 horizontal sums at once, bf16 rounding, exp for non-positive arguments and tanh at both widths, 16-
// and 8-lane stores, an AVX2 horizontal sum, the AVX2 kernels' software prefetch of a weight stream, and a range of
// lines prefetched at once. Every function carries its own target attribute, so including this header does not
// require AVX-512 from the rest of a file; callers select at run time.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <type_traits>

namespace simd {

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the 16 sums of the lanes of v[0 .. 16), element i v[i]'s: a transpose-and-add sharing its shuffles (45 instructions,
// where 16 horizontal sums take ~8 each); each sum adds its vector's lanes in the same order whatever the others hold
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
inline __m512 sums16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)   // each 128-bit lane: its part of the sums of v[4i .. 4i + 4)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-7 Taylor (< 1e-8 relative)
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// the same exp with AVX2 (no scalef: 2^n is built in the exponent bits; n >= -126 keeps it a normal number)
__attribute__((target("avx2,fma")))
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// tanh(x) in fp32, for any x (a few ulp; |x| -> inf gives +-1, NaN stays NaN), at 16 and 8 lanes. With a = |x|:
// a < 0.625: a + a^3 P(a^2), P of degree 4 fitted here (minimax of a^2 (P - (tanh a - a) / a^3) over
// [0, 0.625^2], weighted error 4e-9, below fp32's rounding); else (1 - e) / (1 + e) with e = exp(-2a) in (0, 0.29],
// where 1 - e loses no precision and exp_nonpositive's clamp at -87 makes large |x| give exactly 1. The sign is x's.
// NaN takes the polynomial branch (the compare is unordered), whose arithmetic keeps it.
constexpr float TANH_SMALL = 0.625f;
constexpr float TANH_P0 = -0.3333328392520577f, TANH_P1 = 0.13331491284917343f, TANH_P2 = -0.05374349791589475f,
                TANH_P3 = 0.020650586784146024f, TANH_P4 = -0.005717044510873055f;

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 y = _mm512_mul_ps(a, a);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(TANH_P4), y, _mm512_set1_ps(TANH_P3));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(TANH_P2));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(TANH_P1));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(TANH_P0));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, y), p, a);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 t = _mm512_mask_mov_ps(large, _mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_NGE_UQ), small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

__attribute__((target("avx2,fma")))
inline __m256 tanh8(__m256 x) {
  const __m256 sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 a = _mm256_andnot_ps(sign_bit, x);
  const __m256 y = _mm256_mul_ps(a, a);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(TANH_P4), y, _mm256_set1_ps(TANH_P3));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(TANH_P2));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(TANH_P1));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(TANH_P0));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, y), p, a);
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 large = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(TANH_SMALL), _CMP_NGE_UQ));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign_bit));
}

// 8 lanes of fp32 or bf16 (widened; as at::BFloat16 or its bits) with AVX2
__attribute__((target("avx2,fma")))
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma")))
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma")))
inline __m256 load8(const at::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }

// fp32 -> bf16 -> fp32, round-to-nearest-even, AVX2; and v rounded to the activation dtype T
__attribute__((target("avx2,fma")))
inline __m256 round_to_bf16_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
template <typename T>
__attribute__((target("avx2,fma")))
inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_to_bf16_8(v);
}

// store 8 lanes with AVX2, rounding to nearest even for bf16
__attribute__((target("avx2,fma")))
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
__attribute__((target("avx2,fma")))
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_to_bf16_8(v)), 16);   // 0 .. 65535
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// fp32 -> bf16 -> fp32 with round-to-nearest-even (finite values; NaN is not preserved)
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 round_to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// the sum of the 8 lanes of an AVX2 vector
__attribute__((target("avx2,fma")))
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The AVX2 kernels' software prefetch of the weight stream: each 64-byte line of a row asks for the line this
// far ahead (into the next rows, which the same thread reads next), because the Zen 3-class AVX2 VM's hardware
// prefetchers do not keep a thread's sequential stream ahead of the loads. The AVX-512 kernels take none: on Zen 4
// the same prefetch slowed the bf16 GEMV chain. The numbers, and how far ahead: docs/performance.md, "Choices in
// the code".
constexpr int64_t STREAM_PREFETCH_BYTES = 2048;

__attribute__((always_inline)) inline void prefetch_stream(const void* line) {
  __builtin_prefetch(static_cast<const char*>(line) + STREAM_PREFETCH_BYTES, 0, 3);
}

// every 64-byte line of [row, row + nbytes) asked for at __builtin_prefetch's Locality (3: all levels, 2: L2)
template <int Locality>
__attribute__((always_inline)) inline void prefetch_row(const void* row, int64_t nbytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// v rounded to the activation dtype T (a no-op for fp32), as an eager op's result would be
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_to_bf16(v);
}

// store 16 lanes, rounding to nearest even for bf16
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

}  // namespace simd
