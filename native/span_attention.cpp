// Decode attention over the span KV cache: one query token per sequence.
//
//   q        [B, H, D]        fp32 or bf16 (the activation dtype)
//   k_cache  [S, P, KVH, D]   same dtype as q; S spans of P tokens, KV heads local to this rank
//   v_cache  [S, P, KVH, D]
//   spans    [B, MAXS] int64  span ids of each sequence (padded; only the first ceil(ctx/P) are read)
//   ctx      [B] int64        context length of each sequence (its keys 0..ctx-1, the new one included)
//   out      [B, H, D]        same dtype as q
//
// Each (sequence, KV head) is one task over torch's threads; the query heads that share the KV head
// are done together so each key/value row is read once. Scores, softmax and the weighted sum run in
// fp32 (for bf16 caches the softmax weights are rounded to bf16 before meeting V, like PyTorch's SDPA).
// The loop structure of a task never depends on the other sequences, so a sequence's result is the
// same in any batch. ISA: 2 = AVX-512 (intrinsics when the head dim is a multiple of 16, else the
// generic code compiled for it), 1 = AVX2, 0 = portable (the generic code compiled per target).
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

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

// the cache slot of the sequence's t-th token
inline int64_t slot_of(const int64_t* spans, int64_t t, int64_t P) { return spans[t / P] * P + t % P; }

// A sequence's key/value rows are scattered over its spans and strided by the KV heads, which the hardware
// prefetchers follow poorly, and in a decode step the weights streamed since the previous layer have pushed
// them out of cache. So while scoring key t, the loop asks for key t + PREFETCH_AHEAD (into L1) and value t
// (into L2, read after the softmax). Measured between the q/k/v and o GEMVs of a 0.5 B model (12 heads,
// 4 KV heads, D 128, 200 tokens, 2 threads): bf16 ~90 -> ~45 us per layer, fp32 ~92 -> ~72 us.
constexpr int64_t PREFETCH_AHEAD = 16;

template <int Locality, typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, Locality);
}

template <typename T>
__attribute__((always_inline)) inline void prefetch_for_key(const T* k_cache, const T* v_cache, const int64_t* spans,
                                                            int64_t t, int64_t ctx, int64_t P, int64_t KVH,
                                                            int64_t D, int64_t g) {
  if (t == 0)
    for (int64_t u = 0; u < std::min(PREFETCH_AHEAD, ctx); ++u)
      prefetch_row<3>(k_cache + (slot_of(spans, u, P) * KVH + g) * D, D);
  if (t + PREFETCH_AHEAD < ctx) prefetch_row<3>(k_cache + (slot_of(spans, t + PREFETCH_AHEAD, P) * KVH + g) * D, D);
  prefetch_row<2>(v_cache + (slot_of(spans, t, P) * KVH + g) * D, D);
}

template <typename T>
__attribute__((always_inline)) inline void attend(const T* q, const T* k_cache, const T* v_cache,
                                                  const int64_t* spans, int64_t ctx, int64_t P, int64_t KVH,
                                                  int64_t D, int64_t G, int64_t g, float scale, T* out,
                                                  float* scores, float* qf, float* acc, float* inv_sum) {
  group_query(q, D, G, g, qf);
  for (int64_t t = 0; t < ctx; ++t) {
    prefetch_for_key(k_cache, v_cache, spans, t, ctx, P, KVH, D, g);
    const T* kr = k_cache + (slot_of(spans, t, P) * KVH + g) * D;
    for (int64_t h = 0; h < G; ++h) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qf[h * D + d] * to_f(kr[d]);
      scores[h * ctx + t] = s * scale;
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* sc = scores + h * ctx;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sc[t] = std::exp(sc[t] - m);
      sum += sc[t];
      // reduced-precision caches: the weights meet V in the cache's precision, as in PyTorch's
      // CPU flash attention (which transformers uses), so both round at the same point
      if constexpr (!std::is_same_v<T, float>) sc[t] = to_f(static_cast<T>(sc[t]));
    }
    inv_sum[h] = 1.f / sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vr = v_cache + (slot_of(spans, t, P) * KVH + g) * D;
    for (int64_t h = 0; h < G; ++h) {
      const float p = scores[h * ctx + t];
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vr[d]);
    }
  }
  group_output(acc, inv_sum, D, G, g, out);
}

#define ATTEND_ARGS                                                                                         \
  const T *q, const T *k_cache, const T *v_cache, const int64_t *spans, int64_t ctx, int64_t P, int64_t KVH, \
      int64_t D, int64_t G, int64_t g, float scale, T *out, float *scores, float *qf, float *acc, float *inv_sum
#define ATTEND_CALL q, k_cache, v_cache, spans, ctx, P, KVH, D, G, g, scale, out, scores, qf, acc, inv_sum

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void attend_avx512(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }
template <typename T>
void attend_portable(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }

// AVX-512 for head dims that are multiples of 16 (64, 128, ...): the same algorithm and roundings as
// attend() above, written with intrinsics because the compiler's version of the loops (a horizontal
// reduction per key and head, scalar exp) took ~260 us for 1000 keys x 12 heads x 128 dims.
using simd::exp_nonpositive;
using simd::load16;

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void attend_avx512_d16(ATTEND_ARGS) {
  const int64_t ND = D / 16;
  group_query(q, D, G, g, qf);
  for (int64_t t = 0; t < ctx; ++t) {
    prefetch_for_key(k_cache, v_cache, spans, t, ctx, P, KVH, D, g);
    const T* kr = k_cache + (slot_of(spans, t, P) * KVH + g) * D;
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * D;
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 1 < ND; j += 2) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), load16(kr + 16 * j), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j + 16), load16(kr + 16 * j + 16), s1);
      }
      if (j < ND) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), load16(kr + 16 * j), s0);
      scores[h * ctx + t] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scale;
    }
  }
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
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + t), m));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
      // the weights meet V in the cache's precision (see attend())
      _mm512_mask_storeu_ps(sc + t, mask, simd::round_to<T>(e));
    }
    inv_sum[h] = 1.f / _mm512_reduce_add_ps(sum);
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vr = v_cache + (slot_of(spans, t, P) * KVH + g) * D;
    for (int64_t j = 0; j < ND; ++j) {
      const __m512 v = load16(vr + 16 * j);
      for (int64_t h = 0; h < G; ++h) {
        float* a = acc + h * D + 16 * j;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * ctx + t]), v, _mm512_loadu_ps(a)));
      }
    }
  }
  group_output(acc, inv_sum, D, G, g, out);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& spans,
         const torch::Tensor& ctx, double scale, torch::Tensor& out, int64_t isa) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = kc.size(1), KVH = kc.size(2), MAXS = spans.size(1);
  const int64_t G = H / KVH;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  allspark::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), inv_sum(G), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, g = task % KVH;
      const int64_t n = cp[b];
      scores.resize(G * n);
      const T* qb = qp + b * H * D;
      T* ob = op + b * H * D;
      const int64_t* sb = sp + b * MAXS;
      const float s = static_cast<float>(scale);
      if (isa >= 2 && D % 16 == 0)
        attend_avx512_d16<T>(qb, kp, vp, sb, n, P, KVH, D, G, g, s, ob, scores.data(), qf.data(), acc.data(),
                             inv_sum.data());
      else if (isa >= 2)
        attend_avx512<T>(qb, kp, vp, sb, n, P, KVH, D, G, g, s, ob, scores.data(), qf.data(), acc.data(), inv_sum.data());
      else if (isa == 1)
        attend_avx2<T>(qb, kp, vp, sb, n, P, KVH, D, G, g, s, ob, scores.data(), qf.data(), acc.data(), inv_sum.data());
      else
        attend_portable<T>(qb, kp, vp, sb, n, P, KVH, D, G, g, s, ob, scores.data(), qf.data(), acc.data(), inv_sum.data());
    }
  });
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor spans,
                               torch::Tensor ctx, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "decode_attention: heads");
  TORCH_CHECK(spans.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "decode_attention: int64 indices");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches");
  auto qc = q.contiguous();
  auto sc = spans.contiguous();
  auto cc = ctx.contiguous();
  auto out = torch::empty_like(qc);
  if (qc.scalar_type() == at::kFloat)
    run<float>(qc, k_cache, v_cache, sc, cc, scale, out, isa);
  else if (qc.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(qc, k_cache, v_cache, sc, cc, scale, out, isa);
  else
    TORCH_CHECK(false, "decode_attention: fp32 or bf16 only");
  return out;
}
