// Decode attention over the span KV cache: one query token per sequence.
//
//   q        [B, H, D]        fp32 or bf16 (the activation dtype)
//   k_cache  [S, P, KVH, D]   same dtype as q; S spans of P tokens, KV heads local to this rank
//   v_cache  [S, P, KVH, D]
//   spans    [B, MAXS] int64  span ids of each sequence (padded; only the first ceil(ctx/P) are read, and of
//                             those, with a window, only the ones from (ctx - window) / P on)
//   ctx      [B] int64        context length of each sequence (its keys 0..ctx-1, the new one included)
//   out      [B, H, D]        same dtype as q
//   alibi_slopes [H] fp32     optional (ALiBi models): key t's score gets slope_h * (t - (ctx - 1))
//   softcap                   > 0 (Gemma 2): each score s (scale * q . k) becomes softcap * tanh(s / softcap)
//                             before the bias and the softmax; 0: none
//   window                    > 0 (Gemma 2's sliding layers): only keys t >= ctx - window are attended, and the
//                             rows and spans before them are not read; 0 (or >= ctx): all keys
//
// Each (sequence, KV head) is one task over torch's threads; the query heads that share the KV head
// are done together so each key/value row is read once. Scores, softmax and the weighted sum run in
// fp32 (for bf16 caches the softmax weights are rounded to bf16 before meeting V, like PyTorch's SDPA).
// The loop structure of a task never depends on the other sequences, so a sequence's result is the
// same in any batch. ISA: 4 = AVX-512 BF16 (bf16 caches with head dims a multiple of 32: bf16 dot products; else as
// 2), 2 and 3 = AVX-512 (intrinsics when the head dim is a multiple of 16, else the generic code compiled for it),
// 1 = AVX2, 0 = portable (the generic code compiled per target).
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_common.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

using attn::group_output;
using attn::group_query;
using attn::to_f;

template <typename T>
__attribute__((always_inline)) inline void attend(const T* q, const T* k_cache, const T* v_cache,
                                                  const int64_t* rows, int64_t ctx, int64_t D, int64_t G, int64_t g,
                                                  float scale, const float* slopes, float cap, T* out,
                                                  float* scores, float* qf, float* acc, float* inv_sum) {
  group_query(q, D, G, g, qf);
  for (int64_t t = 0; t < ctx; ++t) {
    attn::prefetch_for_key(k_cache, v_cache, D * sizeof(T), rows, t, ctx);
    const T* kr = k_cache + rows[t] * D;
    for (int64_t h = 0; h < G; ++h) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qf[h * D + d] * to_f(kr[d]);
      scores[h * ctx + t] = s * scale;
    }
  }
  if (cap > 0.f) attn::softcap_scores(scores, G * ctx, cap);
  attn::add_alibi(scores, ctx, G, slopes);
  // reduced-precision caches: the weights meet V in the cache's precision, as in PyTorch's CPU flash
  // attention (which transformers uses), so both round at the same point
  attn::softmax_rows<T>(scores, ctx, G, inv_sum);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    if (t + attn::PREFETCH_AHEAD < ctx)   // see span_attention_quant.cpp: the V rows asked for while scoring
      simd::prefetch_row<3>(v_cache + rows[t + attn::PREFETCH_AHEAD] * D, D * sizeof(T));
    const T* vr = v_cache + rows[t] * D;
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
  const T *q, const T *k_cache, const T *v_cache, const int64_t *rows, int64_t ctx, int64_t D, int64_t G,     \
      int64_t g, float scale, const float *slopes, float cap, T *out, float *scores, float *qf, float *acc,   \
      float *inv_sum
#define ATTEND_CALL q, k_cache, v_cache, rows, ctx, D, G, g, scale, slopes, cap, out, scores, qf, acc, inv_sum

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void attend_avx512(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }
template <typename T>
void attend_portable(ATTEND_ARGS) { attend<T>(ATTEND_CALL); }

// AVX-512 for head dims that are multiples of 16 (64, 128, ...) and AVX2 for multiples of 32: attend()'s
// algorithm and roundings with intrinsics (attention_common.h), because the compiled loops reduce horizontally per
// key and head, call std::exp per score (docs/performance.md, "Choices in the code"), and widen each key row once
// per head. Each key row is widened once for the group's heads; the value sums stay in registers over all keys.
template <typename T, bool V512>
__attribute__((always_inline)) inline void attend_rows(ATTEND_ARGS, std::vector<const T*>& v_rows) {
  using Row = attn::DenseRow<T>;
  group_query(q, D, G, g, qf);
  for (int64_t t = 0; t < ctx; ++t) {
    attn::prefetch_for_key(k_cache, v_cache, D * sizeof(T), rows, t, ctx);
    const T* kr = k_cache + rows[t] * D;
    if constexpr (V512) attn::group_dots_avx512<Row>(qf, kr, D, G, scores + t, ctx);
    else attn::group_dots_avx2<Row>(qf, kr, D, G, scores + t, ctx);
    for (int64_t h = 0; h < G; ++h) scores[h * ctx + t] *= scale;
  }
  if (cap > 0.f) {
    if constexpr (V512) attn::softcap_scores_avx512(scores, G * ctx, cap);
    else attn::softcap_scores_avx2(scores, G * ctx, cap);
  }
  attn::add_alibi(scores, ctx, G, slopes);
  // the weights meet V in the cache's precision
  if constexpr (V512) attn::softmax_rows_avx512<T>(scores, ctx, G, inv_sum);
  else attn::softmax_rows_avx2<T>(scores, ctx, G, inv_sum);
  v_rows.resize(ctx);
  for (int64_t t = 0; t < ctx; ++t) v_rows[t] = v_cache + rows[t] * D;
  if constexpr (V512) attn::group_weighted_rows_avx512<Row>(v_rows.data(), ctx, D, G, scores, acc);
  else attn::group_weighted_rows_avx2<Row>(v_rows.data(), ctx, D, G, scores, acc);
  group_output(acc, inv_sum, D, G, g, out);
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"), flatten))
void attend_avx512_d16(ATTEND_ARGS, std::vector<const T*>& v_rows) { attend_rows<T, true>(ATTEND_CALL, v_rows); }
template <typename T>
__attribute__((target("avx2,fma"), flatten))
void attend_avx2_d32(ATTEND_ARGS, std::vector<const T*>& v_rows) { attend_rows<T, false>(ATTEND_CALL, v_rows); }

// ---- AVX-512 BF16 (bf16 caches, head dims a multiple of 32) ------------------------------------------------
// q, the keys, the softmax weights (rounded to bf16 like attend()'s) and the values are all bf16, so every product is
// exact in fp32 either way: vdpbf16ps takes two products per fp32 lane a cycle where vfmadd231ps takes one, and
// leaves the rows in bf16. Scores: a key's dot with each head in one accumulator, 16 keys' accumulators reduced
// together (a transpose-and-add, ~3 instructions a key instead of a horizontal sum's ~8). Value sums: keys t and
// t + 1 interleaved as bf16 pairs (vpunpck{l,h}wd), met by the pair of their weights; the interleave leaves each
// 128-bit lane's dimensions split in halves, put back in order once at the end.
#define DP_ISA __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline

// scores[h * ctx + t] = scale * q_h . key t for NH heads (q: [NH, D] bf16, D a multiple of 32)
template <int NH>
DP_ISA void dp_scores(const at::BFloat16* q, const at::BFloat16* k_cache, const int64_t* rows, int64_t ctx,
                      int64_t D, float scale, float* scores, int64_t stride, const at::BFloat16* v_cache) {
  alignas(64) __m512 acc[NH][16];
  const int64_t row_bytes = D * 2;
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, ctx - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      if (v_cache) attn::prefetch_for_key(k_cache, v_cache, row_bytes, rows, t, ctx);
      const at::BFloat16* kr = k_cache + rows[t] * D;
      __m512 a[NH];
      for (int h = 0; h < NH; ++h) a[h] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr + d);
        for (int h = 0; h < NH; ++h) a[h] = _mm512_dpbf16_ps(a[h], (__m512bh)_mm512_loadu_si512(q + h * D + d), kv);
      }
      for (int h = 0; h < NH; ++h) acc[h][i] = a[h];
    }
    for (int64_t i = n; i < 16; ++i)
      for (int h = 0; h < NH; ++h) acc[h][i] = _mm512_setzero_ps();
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int h = 0; h < NH; ++h)
      _mm512_mask_storeu_ps(scores + h * stride + t0, mask, _mm512_mul_ps(simd::sums16(acc[h]), _mm512_set1_ps(scale)));
  }
}

// acc[h, :] = sum_t w[h, t] * value t for NH heads, dimensions j .. j + 32 NB (w [NH, ctx] fp32 holding bf16 values)
template <int NH, int NB>
DP_ISA void dp_values(const at::BFloat16* v_cache, const int64_t* rows, int64_t ctx, int64_t D, int64_t j,
                      const float* w, float* out) {
  __m512 lo[NH][NB], hi[NH][NB];
  for (int h = 0; h < NH; ++h)
    for (int b = 0; b < NB; ++b) lo[h][b] = hi[h][b] = _mm512_setzero_ps();
  const int64_t span = 64 * NB;
  auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return u >> 16; };
  for (int64_t t = 0; t < ctx; t += 2) {
    const bool pair = t + 1 < ctx;
    for (int64_t u = t + attn::PREFETCH_AHEAD; u < std::min(ctx, t + attn::PREFETCH_AHEAD + 2); ++u)
      simd::prefetch_row<3>(reinterpret_cast<const char*>(v_cache + rows[u] * D + j), span);
    const at::BFloat16* v0 = v_cache + rows[t] * D + j;
    const at::BFloat16* v1 = pair ? v_cache + rows[t + 1] * D + j : nullptr;
    __m512bh wp[NH];
    for (int h = 0; h < NH; ++h)
      wp[h] = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits(w[h * ctx + t]) |
                                                          (pair ? bits(w[h * ctx + t + 1]) << 16 : 0u)));
    for (int b = 0; b < NB; ++b) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * b);
      const __m512i c = pair ? _mm512_loadu_si512(v1 + 32 * b) : _mm512_setzero_si512();
      const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(a, c), ph = (__m512bh)_mm512_unpackhi_epi16(a, c);
      for (int h = 0; h < NH; ++h) {
        lo[h][b] = _mm512_dpbf16_ps(lo[h][b], wp[h], pl);
        hi[h][b] = _mm512_dpbf16_ps(hi[h][b], wp[h], ph);
      }
    }
  }
  // lane L of lo: dimensions 8L .. 8L + 3 of the block, of hi: 8L + 4 .. 8L + 7
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < NH; ++h)
    for (int b = 0; b < NB; ++b) {
      _mm512_storeu_ps(out + h * D + j + 32 * b, _mm512_permutex2var_ps(lo[h][b], first, hi[h][b]));
      _mm512_storeu_ps(out + h * D + j + 32 * b + 16, _mm512_permutex2var_ps(lo[h][b], second, hi[h][b]));
    }
}

template <int NH>
DP_ISA void dp_values_heads(const at::BFloat16* v_cache, const int64_t* rows, int64_t ctx, int64_t D, const float* w,
                            float* out) {
  int64_t j = 0;
  for (; j + 128 <= D; j += 128) dp_values<NH, 4>(v_cache, rows, ctx, D, j, w, out);
  for (; j < D; j += 32) dp_values<NH, 1>(v_cache, rows, ctx, D, j, w, out);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), flatten))
void attend_bf16_dp(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                    const int64_t* rows, int64_t ctx, int64_t D, int64_t G, int64_t g, float scale,
                    const float* slopes, float cap, at::BFloat16* out, float* scores, float* acc, float* inv_sum) {
  const at::BFloat16* qg = q + g * G * D;
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    const at::BFloat16* vc = h0 == 0 ? v_cache : nullptr;   // the prefetches once, with the first heads
    float* sc = scores + h0 * ctx;
    switch (std::min<int64_t>(4, G - h0)) {
      case 1: dp_scores<1>(qg + h0 * D, k_cache, rows, ctx, D, scale, sc, ctx, vc); break;
      case 2: dp_scores<2>(qg + h0 * D, k_cache, rows, ctx, D, scale, sc, ctx, vc); break;
      case 3: dp_scores<3>(qg + h0 * D, k_cache, rows, ctx, D, scale, sc, ctx, vc); break;
      default: dp_scores<4>(qg + h0 * D, k_cache, rows, ctx, D, scale, sc, ctx, vc); break;
    }
  }
  if (cap > 0.f) attn::softcap_scores_avx512(scores, G * ctx, cap);
  attn::add_alibi(scores, ctx, G, slopes);
  attn::softmax_rows_avx512<at::BFloat16>(scores, ctx, G, inv_sum);
  for (int64_t h0 = 0; h0 < G; h0 += 3) {
    switch (std::min<int64_t>(3, G - h0)) {
      case 1: dp_values_heads<1>(v_cache, rows, ctx, D, scores + h0 * ctx, acc + h0 * D); break;
      case 2: dp_values_heads<2>(v_cache, rows, ctx, D, scores + h0 * ctx, acc + h0 * D); break;
      default: dp_values_heads<3>(v_cache, rows, ctx, D, scores + h0 * ctx, acc + h0 * D); break;
    }
  }
  group_output(acc, inv_sum, D, G, g, out);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& spans,
         const torch::Tensor& ctx, double scale, const float* alibi, float cap, int64_t window, torch::Tensor& out,
         int64_t isa) {
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
    std::vector<int64_t> rows;   // each key's cache row (slot * KVH + g)
    std::vector<const T*> v_rows;   // attend_avx512_d16 / attend_avx2_d32: each key's V row
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, g = task % KVH;
      // the keys attended: [first, cp[b]); the kernels see them as a context of n keys (attn::add_alibi: the bias
      // of key first + i is that of i in a context of n)
      const int64_t first = attn::window_start(cp[b], window), n = cp[b] - first;
      scores.resize(G * n);
      const T* qb = qp + b * H * D;
      T* ob = op + b * H * D;
      rows.resize(n);
      attn::key_rows(sp + b * MAXS, cp[b], P, KVH, g, rows.data(), first);
      const int64_t* r = rows.data();
      const float s = static_cast<float>(scale);
      const float* sl = alibi ? alibi + g * G : nullptr;   // the group's slopes
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        static const bool bf16_dp = __builtin_cpu_supports("avx512bf16");   // a level 4 passed elsewhere: not run
        if (isa >= 4 && bf16_dp && D % 32 == 0) {
          attend_bf16_dp(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), acc.data(), inv_sum.data());
          continue;
        }
      }
      if (isa >= 2 && D % 16 == 0)
        attend_avx512_d16<T>(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), qf.data(), acc.data(),
                             inv_sum.data(), v_rows);
      else if (isa >= 2)
        attend_avx512<T>(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), qf.data(), acc.data(),
                         inv_sum.data());
      else if (isa == 1 && D % 32 == 0)
        attend_avx2_d32<T>(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), qf.data(), acc.data(),
                           inv_sum.data(), v_rows);
      else if (isa == 1)
        attend_avx2<T>(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), qf.data(), acc.data(),
                       inv_sum.data());
      else
        attend_portable<T>(qb, kp, vp, r, n, D, G, g, s, sl, cap, ob, scores.data(), qf.data(), acc.data(),
                           inv_sum.data());
    }
  });
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor spans,
                               torch::Tensor ctx, const AttentionOptions& options, int64_t isa,
                               std::optional<torch::Tensor> alibi_slopes) {
  options.check();
  const double scale = options.scale;
  const int64_t window = options.window;
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
  const float* alibi = attn::alibi_data(alibi_slopes, qc.size(1));
  const float cap = attn::softcap_value(options.softcap);
  if (qc.scalar_type() == at::kFloat)
    run<float>(qc, k_cache, v_cache, sc, cc, scale, alibi, cap, window, out, isa);
  else if (qc.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(qc, k_cache, v_cache, sc, cc, scale, alibi, cap, window, out, isa);
  else
    TORCH_CHECK(false, "decode_attention: fp32 or bf16 only");
  return out;
}

torch::Tensor softcap_scores(torch::Tensor x, double cap, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "softcap_scores: fp32 only");
  const float c = attn::softcap_value(cap);
  TORCH_CHECK(c > 0.f, "softcap_scores: cap must be > 0");
  auto out = x.contiguous().clone();
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  if (isa >= 2) attn::softcap_scores_avx512(p, n, c);
  else if (isa == 1) attn::softcap_scores_avx2(p, n, c);
  else attn::softcap_scores(p, n, c);
  return out;
}

void AttentionOptions::check() const {
  TORCH_CHECK(scale > 0, "attention options: scale must be > 0, not ", scale);
  TORCH_CHECK(softcap >= 0, "attention options: softcap must be >= 0 (0: none), not ", softcap);
  TORCH_CHECK(window >= 0, "attention options: window must be >= 0 (0: no sliding window), not ", window);
}
