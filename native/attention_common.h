// Pieces shared by the decode attention kernels over dense spans (span_attention.cpp) and quantized
// spans (span_attention_quant.cpp): the group of query heads of one KV head, cache slots, and the
// softmax of a group's score rows. Layouts are in span_attention.cpp.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

#include "simd.h"

namespace attn {

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// the G query heads that share KV head g, as fp32 rows [G, D]
template <typename T>
__attribute__((always_inline)) inline void group_query(const T* q, int64_t D, int64_t G, int64_t g, float* qf) {
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(q[(g * G + h) * D + d]);
}

// out rows of the group = acc / softmax sum, rounded once into the activation dtype
template <typename T>
__attribute__((always_inline)) inline void group_output(const float* acc, const float* inv_sum, int64_t D, int64_t G,
                                                        int64_t g, T* out) {
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) out[(g * G + h) * D + d] = static_cast<T>(acc[h * D + d] * inv_sum[h]);
}

// A sequence's key/value rows are scattered over its spans and strided by the KV heads, which the hardware
// prefetchers follow poorly, and in a decode step the weights streamed since the previous layer have pushed
// them out of cache. So while scoring key t, the kernels ask for key t + PREFETCH_AHEAD (into L1) and value t
// (into L2, read after the softmax); docs/performance.md, "Choices in the code", has what that saved.
constexpr int64_t PREFETCH_AHEAD = 16;

// rows[t - first] = the cache row (slot * KVH + g) of the sequence's key t in [first, ctx) for KV head g, filled span
// by span: the kernels index rows by it rather than dividing t by the span size for every key (three 64-bit divisions a
// key were a large part of an AVX-512 attention's time at long contexts). first > 0 (a sliding window): the spans
// wholly before key `first` are not looked up, so nothing of them is ever read.
inline void key_rows(const int64_t* spans, int64_t ctx, int64_t P, int64_t KVH, int64_t g, int64_t* rows,
                     int64_t first = 0) {
  for (int64_t t0 = first - first % P, i = first / P; t0 < ctx; t0 += P, ++i) {
    const int64_t base = spans[i] * P, n = std::min(P, ctx - t0);
    for (int64_t o = std::max<int64_t>(0, first - t0); o < n; ++o) rows[t0 + o - first] = (base + o) * KVH + g;
  }
}

// The keys a query at position ctx - 1 sees: [window_start(ctx, window), ctx). window > 0 (Gemma 2's sliding
// layers) keeps the keys t with (ctx - 1) - t < window, as HF's sliding-window mask; 0 keeps them all.
inline int64_t window_start(int64_t ctx, int64_t window) { return window > 0 && window < ctx ? ctx - window : 0; }

// the prefetches made while scoring key t; a cache row (one token, KV head) is row_bytes long, rows: key_rows
__attribute__((always_inline)) inline void prefetch_for_key(const void* k_cache, const void* v_cache,
                                                            int64_t row_bytes, const int64_t* rows, int64_t t,
                                                            int64_t ctx) {
  const char* k = static_cast<const char*>(k_cache);
  const char* v = static_cast<const char*>(v_cache);
  if (t == 0)
    for (int64_t u = 0; u < std::min(PREFETCH_AHEAD, ctx); ++u)
      simd::prefetch_row<3>(k + rows[u] * row_bytes, row_bytes);
  if (t + PREFETCH_AHEAD < ctx) simd::prefetch_row<3>(k + rows[t + PREFETCH_AHEAD] * row_bytes, row_bytes);
  simd::prefetch_row<2>(v + rows[t] * row_bytes, row_bytes);
}

// ALiBi (allspark_server/compute/alibi.py): the G score rows [ctx] of one query at position ctx - 1 get
// slope_h * (t - (ctx - 1)) added, slopes [G] the group's; no slopes (null), no bias. Under a sliding window the
// rows hold keys first .. first + ctx - 1 of a context of first + ctx tokens: score i is key first + i's, and
// (first + i) - (first + ctx - 1) = i - (ctx - 1), so the bias is the one of the true key positions.
__attribute__((always_inline)) inline void add_alibi(float* scores, int64_t ctx, int64_t G, const float* slopes) {
  if (slopes == nullptr) return;
  for (int64_t h = 0; h < G; ++h) {
    float* sc = scores + h * ctx;
    const float slope = slopes[h];
    for (int64_t t = 0; t < ctx; ++t) sc[t] += slope * static_cast<float>(t - (ctx - 1));
  }
}

// the slopes tensor of a decode attention call: null without one, else fp32 [H] checked against the heads
inline const float* alibi_data(const std::optional<torch::Tensor>& slopes, int64_t H) {
  if (!slopes) return nullptr;
  TORCH_CHECK(slopes->scalar_type() == at::kFloat && slopes->dim() == 1 && slopes->size(0) == H &&
                  slopes->is_contiguous() && slopes->device().is_cpu(),
              "decode_attention: alibi_slopes must be a contiguous fp32 CPU tensor [heads = ", H, "]");
  return slopes->data_ptr<float>();
}

// the softcap argument of a decode attention call as the kernels take it: 0 (none) or a finite cap > 0
inline float softcap_value(double softcap) {
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(softcap == 0.0 || (std::isfinite(cap) && cap > 0.f),
              "decode_attention: softcap must be 0 (no soft-capping) or a positive fp32 number, not ", softcap);
  return cap;
}

// Logit soft-capping (Gemma 2): each of the n scores s (already scaled) becomes cap * tanh(s / cap), as HF computes it
// (divide, tanh, multiply, in fp32), before any bias and the softmax. The kernels call it only when cap > 0, once
// per (sequence, KV head) task, so uncapped attention does no extra work per score. Portable: std::tanh.
inline void softcap_scores(float* scores, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// the same with simd::tanh16 (a few ulp from std::tanh)
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void softcap_scores_avx512(float* scores, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scores + i);
    _mm512_mask_storeu_ps(scores + i, mask, _mm512_mul_ps(c, simd::tanh16(_mm512_div_ps(s, c))));
  }
}

// the same with simd::tanh8; the last n % 8 scores as one vector with the other lanes zero
__attribute__((target("avx2,fma")))
inline void softcap_scores_avx2(float* scores, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(scores + i, _mm256_mul_ps(c, simd::tanh8(_mm256_div_ps(_mm256_loadu_ps(scores + i), c))));
  if (i < n) {
    alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(scores + i, scores + n, tail);
    _mm256_store_ps(tail, _mm256_mul_ps(c, simd::tanh8(_mm256_div_ps(_mm256_load_ps(tail), c))));
    std::copy(tail, tail + (n - i), scores + i);
  }
}

// Each of the G score rows [ctx] becomes exp(s - max) in place, rounded to W (the precision the weights
// meet V in: the cache's dtype for dense caches, as in PyTorch's CPU flash attention; fp32 for quantized
// ones), and inv_sum[h] = 1 / the row's unrounded sum.
template <typename W>
__attribute__((always_inline)) inline void softmax_rows(float* scores, int64_t ctx, int64_t G, float* inv_sum) {
  for (int64_t h = 0; h < G; ++h) {
    float* sc = scores + h * ctx;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sc[t] = std::exp(sc[t] - m);
      sum += sc[t];
      if constexpr (!std::is_same_v<W, float>) sc[t] = to_f(static_cast<W>(sc[t]));
    }
    inv_sum[h] = 1.f / sum;
  }
}

// the same with AVX-512 and simd::exp_nonpositive (written with intrinsics: the compiler's version of
// softmax_rows keeps std::exp scalar)
template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void softmax_rows_avx512(float* scores, int64_t ctx, int64_t G, float* inv_sum) {
  const int64_t C16 = ctx - ctx % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - C16)) - 1);
  for (int64_t h = 0; h < G; ++h) {
    float* sc = scores + h * ctx;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < C16; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sc + t));
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, sc + C16));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 mask = t < C16 ? static_cast<__mmask16>(0xFFFF) : tail;
      const __m512 e = simd::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + t), m));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
      _mm512_mask_storeu_ps(sc + t, mask, simd::round_to<W>(e));
    }
    inv_sum[h] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// the same with AVX2 (simd::exp_nonpositive8): the compiled softmax_rows calls std::exp once per score, which
// made most of a 2048-token decode attention's time on the AVX2 VM
template <typename W>
__attribute__((target("avx2,fma")))
inline void softmax_rows_avx2(float* scores, int64_t ctx, int64_t G, float* inv_sum) {
  const int64_t C8 = ctx - ctx % 8;
  for (int64_t h = 0; h < G; ++h) {
    float* sc = scores + h * ctx;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < C8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
    for (int64_t t = C8; t < ctx; ++t) m = std::max(m, sc[t]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < C8; t += 8) {
      const __m256 e = simd::exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mb));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(sc + t, simd::round_to8<W>(e));
    }
    float tail = 0.f;
    for (int64_t t = C8; t < ctx; ++t) {   // the last ctx % 8 scores, one vector with the others zero
      alignas(32) float one[8] = {sc[t] - m, 0, 0, 0, 0, 0, 0, 0};
      _mm256_store_ps(one, simd::exp_nonpositive8(_mm256_load_ps(one)));
      tail += one[0];
      sc[t] = one[0];
      if constexpr (!std::is_same_v<W, float>) sc[t] = to_f(static_cast<W>(sc[t]));
    }
    inv_sum[h] = 1.f / (simd::hsum8(sum) + tail);
  }
}

// ---- AVX2 and AVX-512: scores and value sums over rows of any storage ----------------------------------------
// A Row policy reads 8 (load8, AVX2) or 16 (load16, AVX-512) values of a cache row (elements d .., d a multiple of
// 8 / 16) as fp32: dense rows (bf16 / fp32) here, quantized codes (int8 / uint4) in span_attention_quant.cpp.
// `byte_of(d)`: where element d's bytes start in the row.
template <typename T>
struct DenseRow {
  using Ptr = const T*;
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 load8(Ptr row, int64_t d, int64_t) {
    return simd::load8(row + d);
  }
  __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline __m512 load16(Ptr row, int64_t d,
                                                                                                  int64_t) {
    return simd::load16(row + d);
  }
  static int64_t byte_of(int64_t d, int64_t) { return d * static_cast<int64_t>(sizeof(T)); }
};

// dots[h * stride] = q_h . row for the NH query rows qf [NH, D] (D a multiple of 16), the row widened once
template <typename Row, int NH>
__attribute__((target("avx2,fma")))
inline void row_dots_avx2(const float* qf, typename Row::Ptr row, int64_t D, float* dots, int64_t stride) {
  __m256 s0[NH], s1[NH];
  for (int h = 0; h < NH; ++h) s0[h] = _mm256_setzero_ps(), s1[h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 k0 = Row::load8(row, d, D), k1 = Row::load8(row, d + 8, D);
    for (int h = 0; h < NH; ++h) {
      s0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + h * D + d), k0, s0[h]);
      s1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + h * D + d + 8), k1, s1[h]);
    }
  }
  for (int h = 0; h < NH; ++h) dots[h * stride] = simd::hsum8(_mm256_add_ps(s0[h], s1[h]));
}

// acc[h, :] = sum_t w[h, t] * row_t for NH heads (w [NH, ctx]; D a multiple of 32; rows[t]: the row of key t):
// 32 dimensions at a time over all keys with the heads' sums in registers, so each line of a row is read once
// (the axpy form loads and stores the accumulators for every row and head)
template <typename Row, int NH>
__attribute__((target("avx2,fma")))
inline void weighted_rows_avx2(const typename Row::Ptr* rows, int64_t ctx, int64_t D, const float* w, float* acc) {
  for (int64_t j = 0; j < D; j += 32) {
    __m256 a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 4; ++i) a[h][i] = _mm256_setzero_ps();
    const int64_t at = Row::byte_of(j, D), span = Row::byte_of(j + 31, D) - at + 1;
    for (int64_t t = 0; t < ctx; ++t) {
      if (t + PREFETCH_AHEAD < ctx)
        simd::prefetch_row<3>(reinterpret_cast<const char*>(rows[t + PREFETCH_AHEAD]) + at, span);
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = Row::load8(rows[t], j + 8 * i, D);
      for (int h = 0; h < NH; ++h) {
        const __m256 wt = _mm256_set1_ps(w[h * ctx + t]);
        for (int i = 0; i < 4; ++i) a[h][i] = _mm256_fmadd_ps(wt, v[i], a[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + h * D + j + 8 * i, a[h][i]);
  }
}

// the two above for all G heads of a group, in blocks of up to 4 heads (registers)
template <typename Row>
__attribute__((target("avx2,fma")))
inline void group_dots_avx2(const float* qf, typename Row::Ptr row, int64_t D, int64_t G, float* dots,
                            int64_t stride) {
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    float* out = dots + h0 * stride;
    switch (std::min<int64_t>(4, G - h0)) {
      case 1: row_dots_avx2<Row, 1>(qf + h0 * D, row, D, out, stride); break;
      case 2: row_dots_avx2<Row, 2>(qf + h0 * D, row, D, out, stride); break;
      case 3: row_dots_avx2<Row, 3>(qf + h0 * D, row, D, out, stride); break;
      default: row_dots_avx2<Row, 4>(qf + h0 * D, row, D, out, stride); break;
    }
  }
}
template <typename Row>
__attribute__((target("avx2,fma")))
inline void group_weighted_rows_avx2(const typename Row::Ptr* rows, int64_t ctx, int64_t D, int64_t G,
                                     const float* w, float* acc) {
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    switch (std::min<int64_t>(4, G - h0)) {
      case 1: weighted_rows_avx2<Row, 1>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
      case 2: weighted_rows_avx2<Row, 2>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
      case 3: weighted_rows_avx2<Row, 3>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
      default: weighted_rows_avx2<Row, 4>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
    }
  }
}

// ---- AVX-512 (D a multiple of 16) --------------------------------------------------------------------------
// dots[h * stride] = q_h . row for the NH query rows qf [NH, D], each 16 values of the row widened once for all
// NH heads (two accumulators per head: 16-blocks 0, 2, 4, ... and 1, 3, 5, ..., added, then reduced)
template <typename Row, int NH>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
inline void row_dots_avx512(const float* qf, typename Row::Ptr row, int64_t D, float* dots, int64_t stride) {
  __m512 s0[NH], s1[NH];
  for (int h = 0; h < NH; ++h) s0[h] = _mm512_setzero_ps(), s1[h] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m512 k0 = Row::load16(row, d, D), k1 = Row::load16(row, d + 16, D);
    for (int h = 0; h < NH; ++h) {
      s0[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * D + d), k0, s0[h]);
      s1[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * D + d + 16), k1, s1[h]);
    }
  }
  if (d < D) {
    const __m512 k0 = Row::load16(row, d, D);
    for (int h = 0; h < NH; ++h) s0[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * D + d), k0, s0[h]);
  }
  for (int h = 0; h < NH; ++h) dots[h * stride] = _mm512_reduce_add_ps(_mm512_add_ps(s0[h], s1[h]));
}

// acc[h, j .. j + 16 NJ) = sum_t w[h, t] * row_t[j ..] for NH heads (w [NH, ctx], rows[t]: key t's row): the NH x NJ
// sums held in registers over all keys, so a pass reads each row's 16 NJ values once and stores nothing per key
// (the axpy form loads and stores every accumulator for every key and head). Sums run over t in order from 0.
template <typename Row, int NH, int NJ>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
inline void weighted_rows_avx512(const typename Row::Ptr* rows, int64_t ctx, int64_t D, int64_t j, const float* w,
                                 float* acc) {
  __m512 a[NH][NJ];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < NJ; ++i) a[h][i] = _mm512_setzero_ps();
  const int64_t at = Row::byte_of(j, D), span = Row::byte_of(j + 16 * NJ - 1, D) - at + 1;
  for (int64_t t = 0; t < ctx; ++t) {
    if (t + PREFETCH_AHEAD < ctx)
      simd::prefetch_row<3>(reinterpret_cast<const char*>(rows[t + PREFETCH_AHEAD]) + at, span);
    __m512 v[NJ];
    for (int i = 0; i < NJ; ++i) v[i] = Row::load16(rows[t], j + 16 * i, D);
    for (int h = 0; h < NH; ++h) {
      const __m512 wt = _mm512_set1_ps(w[h * ctx + t]);
      for (int i = 0; i < NJ; ++i) a[h][i] = _mm512_fmadd_ps(wt, v[i], a[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < NJ; ++i) _mm512_storeu_ps(acc + h * D + j + 16 * i, a[h][i]);
}

// the two above for all G heads of a group: dots in blocks of up to 4 heads; value sums in blocks of up to 3
// heads x 8 vectors (24 of the 32 registers: one pass over the rows for D = 128 and groups of up to 3 heads)
template <typename Row>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void group_dots_avx512(const float* qf, typename Row::Ptr row, int64_t D, int64_t G, float* dots,
                              int64_t stride) {
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    float* out = dots + h0 * stride;
    switch (std::min<int64_t>(4, G - h0)) {
      case 1: row_dots_avx512<Row, 1>(qf + h0 * D, row, D, out, stride); break;
      case 2: row_dots_avx512<Row, 2>(qf + h0 * D, row, D, out, stride); break;
      case 3: row_dots_avx512<Row, 3>(qf + h0 * D, row, D, out, stride); break;
      default: row_dots_avx512<Row, 4>(qf + h0 * D, row, D, out, stride); break;
    }
  }
}

template <typename Row, int NH>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
inline void heads_weighted_rows_avx512(const typename Row::Ptr* rows, int64_t ctx, int64_t D, const float* w,
                                       float* acc) {
  int64_t j = 0;
  for (; j + 128 <= D; j += 128) weighted_rows_avx512<Row, NH, 8>(rows, ctx, D, j, w, acc);
  if (j + 64 <= D) weighted_rows_avx512<Row, NH, 4>(rows, ctx, D, j, w, acc), j += 64;
  if (j + 32 <= D) weighted_rows_avx512<Row, NH, 2>(rows, ctx, D, j, w, acc), j += 32;
  if (j < D) weighted_rows_avx512<Row, NH, 1>(rows, ctx, D, j, w, acc);
}

template <typename Row>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void group_weighted_rows_avx512(const typename Row::Ptr* rows, int64_t ctx, int64_t D, int64_t G,
                                       const float* w, float* acc) {
  for (int64_t h0 = 0; h0 < G; h0 += 3) {
    switch (std::min<int64_t>(3, G - h0)) {
      case 1: heads_weighted_rows_avx512<Row, 1>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
      case 2: heads_weighted_rows_avx512<Row, 2>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
      default: heads_weighted_rows_avx512<Row, 3>(rows, ctx, D, w + h0 * ctx, acc + h0 * D); break;
    }
  }
}

}  // namespace attn
