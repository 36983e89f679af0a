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
// (into L2, read after the softmax). Measured between the q/k/v and o GEMVs of a 0.5 B model (12 heads,
// 4 KV heads, D 128, 200 tokens, 2 threads): bf16 ~90 -> ~45 us per layer, fp32 ~92 -> ~72 us.
constexpr int64_t PREFETCH_AHEAD = 16;

// the cache slot of the sequence's t-th token
inline int64_t slot_of(const int64_t* spans, int64_t t, int64_t P) { return spans[t / P] * P + t % P; }

template <int Locality>
__attribute__((always_inline)) inline void prefetch_row(const void* row, int64_t nbytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}


// the prefetches made while scoring key t; a cache row (one token, KV head g) is row_bytes long
__attribute__((always_inline)) inline void prefetch_for_key(const void* k_cache, const void* v_cache,
                                                            int64_t row_bytes, const int64_t* spans, int64_t t,
                                                            int64_t ctx, int64_t P, int64_t KVH, int64_t g) {
  const char* k = static_cast<const char*>(k_cache);
  const char* v = static_cast<const char*>(v_cache);
  if (t == 0)
    for (int64_t u = 0; u < std::min(PREFETCH_AHEAD, ctx); ++u)
      prefetch_row<3>(k + (slot_of(spans, u, P) * KVH + g) * row_bytes, row_bytes);
  if (t + PREFETCH_AHEAD < ctx)
    prefetch_row<3>(k + (slot_of(spans, t + PREFETCH_AHEAD, P) * KVH + g) * row_bytes, row_bytes);
  prefetch_row<2>(v + (slot_of(spans, t, P) * KVH + g) * row_bytes, row_bytes);
}

// ALiBi (allspark_server/layers/alibi.py): the G score rows [ctx] of one query at position ctx - 1 get
// slope_h * (t - (ctx - 1)) added, slopes [G] the group's; no slopes (null), no bias
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

}  // namespace attn
