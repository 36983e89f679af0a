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
// same in any batch. ISA: 2 = AVX-512 (intrinsics when the head dim is a multiple of 16, else the
// generic code compiled for it), 1 = AVX2, 0 = portable (the generic code compiled per target).
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_common.h"
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
      attn::prefetch_row<3>(v_cache + rows[t + attn::PREFETCH_AHEAD] * D, D * sizeof(T));
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
// key and head, call std::exp per score (~260 us for 1000 keys x 12 heads x 128 dims), and widen each key row once
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
                               torch::Tensor ctx, double scale, int64_t isa,
                               std::optional<torch::Tensor> alibi_slopes, double softcap, int64_t window) {
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
  const float cap = attn::softcap_value(softcap);
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0 (0: no sliding window), not ", window);
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
