// Quantized KV spans (kv_cache_mode int8 / uint4): the cache write that quantizes rows, and decode attention
// that reads them. Formats and the torch reference: allspark_server/quant/kv.py.
//
//   codes   int8 [S, P, KVH, D] (int8) | uint8 [S, P, KVH, D/2] (uint4: byte j = element j in the low nibble,
//           element D/2 + j in the high nibble)
//   params  fp32 [S, P, KVH, 2]: (scale, zero) of each row; a row reads back as (code - zero) * scale
//   q, spans, ctx, out, alibi_slopes, softcap, window as in span_attention.cpp
//
// Attention works on the codes: a score is s_t * (q . c_t - z_t * sum(q)) * scale_attn, and the output
// accumulates w = p * s_t times the codes of V and, apart, w * z_t, taken off at the end. A key row's codes
// are widened to fp32 once for the G query heads of the KV head; with intrinsics the V sums run 128 (AVX-512) or
// 32 (AVX2) dimensions at a time over all keys with the heads' sums in registers. Scores, softmax and
// sums are fp32, and the softmax weights stay fp32 (the reference is fp32 attention over the dequantized
// rows). ISA: 2 = AVX-512 (intrinsics when D is a multiple of 16 for int8, 32 for uint4), 1 = AVX2
// (intrinsics when D is a multiple of 32: attention_common.h's row dots and weighted rows over the codes), 0 =
// portable (the generic code compiled per target).
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "attention_common.h"
#include "kernels.h"
#include "parallel.h"

namespace {

enum Mode : int { I8 = 0, U4 = 1 };

template <int M>
constexpr int64_t row_bytes(int64_t D) { return M == I8 ? D : D / 2; }

// ---- the cache write ----------------------------------------------------------------------------------
// x [D] -> codes, (scale, zero): the arithmetic of quant/kv.py `quantize_rows`, operation for operation
template <int M, typename T>
void quantize_row(const T* x, int64_t D, uint8_t* codes, float* param) {
  constexpr float levels = M == I8 ? 255.f : 15.f;
  constexpr float cmin = M == I8 ? -128.f : 0.f, cmax = M == I8 ? 127.f : 15.f;
  float lo = 0.f, hi = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float v = static_cast<float>(x[d]);
    lo = std::min(lo, v), hi = std::max(hi, v);
  }
  const float s = (hi - lo) / levels;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  const float z = std::nearbyint(-lo * inv) + cmin;
  auto code = [&](int64_t d) {
    return std::clamp(std::nearbyint(static_cast<float>(x[d]) * inv) + z, cmin, cmax);
  };
  if constexpr (M == I8) {
    for (int64_t d = 0; d < D; ++d) codes[d] = static_cast<uint8_t>(static_cast<int8_t>(code(d)));
  } else {
    const int64_t h = D / 2;
    for (int64_t j = 0; j < h; ++j)
      codes[j] = static_cast<uint8_t>(static_cast<int>(code(j)) | (static_cast<int>(code(h + j)) << 4));
  }
  param[0] = s, param[1] = z;
}

template <int M, typename T>
void store_rows(const T* src, int64_t src_stride, const int64_t* slots, int64_t B, int64_t KVH, int64_t D,
                uint8_t* codes, float* params) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t r = slots[b] * KVH + h;
      quantize_row<M, T>(src + b * src_stride + h * D, D, codes + r * row_bytes<M>(D), params + 2 * r);
    }
}

// ---- attention --------------------------------------------------------------------------------------
// one row's codes widened to fp32 [D]
template <int M>
__attribute__((always_inline)) inline void widen(const uint8_t* row, int64_t D, float* out) {
  if constexpr (M == I8) {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(static_cast<int8_t>(row[d]));
  } else {
    const int64_t h = D / 2;
    for (int64_t j = 0; j < h; ++j) out[j] = static_cast<float>(row[j] & 0xF), out[h + j] = static_cast<float>(row[j] >> 4);
  }
}

// dot(a, b) and y += w * x over D fp32 values (the loops compiled for the target)
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}
__attribute__((always_inline)) inline void axpy(float w, const float* x, float* y, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += w * x[d];
}
struct Scratch {   // per thread: [G, D] query rows and accumulators, [G, ctx] scores, one widened row
  std::vector<float> qf, acc, scores, row, qsum, zacc, inv_sum;
  std::vector<int64_t> rows;   // [ctx] each key's cache row (slot * KVH + g: attn::key_rows)
  std::vector<const uint8_t*> row_ptrs;   // AVX2 / AVX-512: [ctx] each key's V row
  Scratch(int64_t G, int64_t D) : qf(G * D), acc(G * D), row(D), qsum(G), zacc(G), inv_sum(G) {}
};

// a row of codes for the AVX2 / AVX-512 pieces of attention_common.h: 8 or 16 codes as fp32 (uint4: element d in
// the low nibble of byte d, or in the high nibble of byte d - D/2)
template <int M>
struct CodesRow {
  using Ptr = const uint8_t*;
  // the 8 (WIDE: 16) codes of elements d .. as bytes (uint4: each in its byte's low nibble)
  template <bool WIDE>
  __attribute__((always_inline)) static inline __m128i code_bytes(Ptr row, int64_t d, int64_t D) {
    const uint8_t* p = row + byte_of(d, D);
    __m128i b = WIDE ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                     : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (M == U4) {
      if (d >= D / 2) b = _mm_srli_epi16(b, 4);
      b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    }
    return b;
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 load8(Ptr row, int64_t d, int64_t D) {
    const __m128i b = code_bytes<false>(row, d, D);
    return _mm256_cvtepi32_ps(M == I8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
  // 16 codes (AVX-512; uint4: D a multiple of 32, so 16 elements never straddle the two halves)
  __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline __m512 load16(Ptr row, int64_t d,
                                                                                                  int64_t D) {
    const __m128i b = code_bytes<true>(row, d, D);
    return _mm512_cvtepi32_ps(M == I8 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
  static int64_t byte_of(int64_t d, int64_t D) { return M == I8 || d < D / 2 ? d : d - D / 2; }
};

// one (sequence, KV head g) task. V: AVX512 / AVX2 the intrinsics of attention_common.h (row dots, softmax,
// weighted rows over CodesRow); GENERIC the loops compiled for the target
enum Vec : int { GENERIC, AVX2, AVX512 };
template <int M, int V, typename T>
__attribute__((always_inline)) inline void attend(const T* q, const uint8_t* kc, const float* kp, const uint8_t* vc,
                                                  const float* vp, int64_t ctx, int64_t D, int64_t G, int64_t g,
                                                  float scale, const float* slopes, float cap, T* out,
                                                  Scratch& s) {
  constexpr bool V512 = V == AVX512;
  const int64_t W = row_bytes<M>(D);
  float* qf = s.qf.data();
  float* row = s.row.data();
  float* scores = s.scores.data();
  attn::group_query(q, D, G, g, qf);
  for (int64_t h = 0; h < G; ++h) s.qsum[h] = std::accumulate(qf + h * D, qf + (h + 1) * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    attn::prefetch_for_key(kc, vc, W, s.rows.data(), t, ctx);
    const int64_t r = s.rows[t];
    const float ks = kp[2 * r] * scale, kz = kp[2 * r + 1];
    if constexpr (V != GENERIC) {
      if constexpr (V512) attn::group_dots_avx512<CodesRow<M>>(qf, kc + r * W, D, G, scores + t, ctx);
      else attn::group_dots_avx2<CodesRow<M>>(qf, kc + r * W, D, G, scores + t, ctx);
      for (int64_t h = 0; h < G; ++h) scores[h * ctx + t] = (scores[h * ctx + t] - kz * s.qsum[h]) * ks;
      continue;
    }
    widen<M>(kc + r * W, D, row);
    for (int64_t h = 0; h < G; ++h) scores[h * ctx + t] = (dot(qf + h * D, row, D) - kz * s.qsum[h]) * ks;
  }
  if (cap > 0.f) {   // soft-capping (span_attention.cpp), once per task
    if constexpr (V512) attn::softcap_scores_avx512(scores, G * ctx, cap);
    else if constexpr (V == AVX2) attn::softcap_scores_avx2(scores, G * ctx, cap);
    else attn::softcap_scores(scores, G * ctx, cap);
  }
  attn::add_alibi(scores, ctx, G, slopes);
  if constexpr (V512) attn::softmax_rows_avx512<float>(scores, ctx, G, s.inv_sum.data());
  else if constexpr (V == AVX2) attn::softmax_rows_avx2<float>(scores, ctx, G, s.inv_sum.data());
  else attn::softmax_rows<float>(scores, ctx, G, s.inv_sum.data());
  std::fill(s.zacc.begin(), s.zacc.end(), 0.f);
  if constexpr (V != GENERIC) {   // group_weighted_rows_avx512 / _avx2 write every accumulator
    s.row_ptrs.resize(ctx);
    for (int64_t t = 0; t < ctx; ++t) {   // the weights w = p * s_t, and sum_t w * z_t apart
      const int64_t r = s.rows[t];
      s.row_ptrs[t] = vc + r * W;
      for (int64_t h = 0; h < G; ++h) {
        scores[h * ctx + t] *= vp[2 * r];
        s.zacc[h] += scores[h * ctx + t] * vp[2 * r + 1];
      }
    }
    const uint8_t* const* v_rows = s.row_ptrs.data();
    if constexpr (V512) attn::group_weighted_rows_avx512<CodesRow<M>>(v_rows, ctx, D, G, scores, s.acc.data());
    else attn::group_weighted_rows_avx2<CodesRow<M>>(v_rows, ctx, D, G, scores, s.acc.data());
  } else {
    std::fill(s.acc.begin(), s.acc.end(), 0.f);
    for (int64_t t = 0; t < ctx; ++t) {
      if (t + attn::PREFETCH_AHEAD < ctx)   // the rows asked for into L2 while scoring have often left it
        simd::prefetch_row<3>(vc + s.rows[t + attn::PREFETCH_AHEAD] * W, W);
      const int64_t r = s.rows[t];
      widen<M>(vc + r * W, D, row);
      const float vs = vp[2 * r], vz = vp[2 * r + 1];
      for (int64_t h = 0; h < G; ++h) {
        const float w = scores[h * ctx + t] * vs;
        s.zacc[h] += w * vz;
        axpy(w, row, s.acc.data() + h * D, D);
      }
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) s.acc[h * D + d] -= s.zacc[h];
  attn::group_output(s.acc.data(), s.inv_sum.data(), D, G, g, out);
}

#define ATTEND_ARGS                                                                                            \
  const T *q, const uint8_t *kc, const float *kp, const uint8_t *vc, const float *vp, int64_t ctx, int64_t D,   \
      int64_t G, int64_t g, float scale, const float *slopes, float cap, T *out, Scratch &s
#define ATTEND_CALL q, kc, kp, vc, vp, ctx, D, G, g, scale, slopes, cap, out, s

// flatten: the intrinsic helpers (attention_common.h, CodesRow) carry their target attribute, so they cannot be
// always_inline into the target-less attend(); flatten inlines them here, where the target allows it
template <int M, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"), flatten)) void attend_avx512_v(ATTEND_ARGS) {
  attend<M, AVX512, T>(ATTEND_CALL);
}
template <int M, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void attend_avx512(ATTEND_ARGS) {
  attend<M, GENERIC, T>(ATTEND_CALL);
}
template <int M, typename T>
__attribute__((target("avx2,fma"), flatten)) void attend_avx2_v(ATTEND_ARGS) { attend<M, AVX2, T>(ATTEND_CALL); }
template <int M, typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(ATTEND_ARGS) { attend<M, GENERIC, T>(ATTEND_CALL); }
template <int M, typename T>
void attend_portable(ATTEND_ARGS) { attend<M, GENERIC, T>(ATTEND_CALL); }

template <int M, typename T>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& kp, const torch::Tensor& vc,
         const torch::Tensor& vp, const torch::Tensor& spans, const torch::Tensor& ctx, double scale,
         const float* alibi, float cap, int64_t window, torch::Tensor& out, int64_t isa) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = kc.size(1), KVH = kc.size(2), MAXS = spans.size(1), G = H / KVH;
  const bool v512 = isa >= 2 && D % (M == I8 ? 16 : 32) == 0;
  const T* qp = q.data_ptr<T>();
  const auto* kcp = static_cast<const uint8_t*>(kc.data_ptr());
  const auto* vcp = static_cast<const uint8_t*>(vc.data_ptr());
  const float* kpp = kp.data_ptr<float>();
  const float* vpp = vp.data_ptr<float>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  allspark::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    Scratch s(G, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, g = task % KVH;
      // the keys attended: [first, cp[b]), seen by the kernels as a context of n keys (span_attention.cpp)
      const int64_t first = attn::window_start(cp[b], window), n = cp[b] - first;
      s.scores.resize(G * n);
      const T* qb = qp + b * H * D;
      T* ob = op + b * H * D;
      s.rows.resize(n);
      attn::key_rows(sp + b * MAXS, cp[b], P, KVH, g, s.rows.data(), first);
      const float sc = static_cast<float>(scale);
      const float* sl = alibi ? alibi + g * G : nullptr;   // the group's slopes
      if (v512) attend_avx512_v<M, T>(qb, kcp, kpp, vcp, vpp, n, D, G, g, sc, sl, cap, ob, s);
      else if (isa >= 2) attend_avx512<M, T>(qb, kcp, kpp, vcp, vpp, n, D, G, g, sc, sl, cap, ob, s);
      else if (isa == 1 && D % 32 == 0) attend_avx2_v<M, T>(qb, kcp, kpp, vcp, vpp, n, D, G, g, sc, sl, cap, ob, s);
      else if (isa == 1) attend_avx2<M, T>(qb, kcp, kpp, vcp, vpp, n, D, G, g, sc, sl, cap, ob, s);
      else attend_portable<M, T>(qb, kcp, kpp, vcp, vpp, n, D, G, g, sc, sl, cap, ob, s);
    }
  });
}

// the mode of a quantized cache from its codes, checked against its params and the head dim
int check_quant_cache(const torch::Tensor& codes, const torch::Tensor& params, int64_t D, const char* what) {
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && params.is_contiguous(), what, ": contiguous 4-D caches");
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.dim() == 4 && params.size(3) == 2 &&
                  params.sizes().slice(0, 3) == codes.sizes().slice(0, 3),
              what, ": params must be fp32 [S, P, KVH, 2] beside the codes");
  if (codes.scalar_type() == at::kChar) {
    TORCH_CHECK(codes.size(3) == D, what, ": int8 codes must hold D = ", D, " per row");
    return I8;
  }
  TORCH_CHECK(codes.scalar_type() == at::kByte && D % 2 == 0 && codes.size(3) == D / 2, what,
              ": uint4 codes must be uint8 with D / 2 bytes per row (D = ", D, ")");
  return U4;
}

}  // namespace

torch::Tensor decode_attention_quant(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_param,
                                     torch::Tensor v_codes, torch::Tensor v_param, torch::Tensor spans,
                                     torch::Tensor ctx, const AttentionOptions& options, int64_t isa,
                                     std::optional<torch::Tensor> alibi_slopes) {
  options.check();
  const double scale = options.scale;
  const int64_t window = options.window;
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [B, H, D]");
  const int mode = check_quant_cache(k_codes, k_param, q.size(2), "decode_attention");
  TORCH_CHECK(check_quant_cache(v_codes, v_param, q.size(2), "decode_attention") == mode &&
                  v_codes.sizes() == k_codes.sizes(), "decode_attention: K and V caches differ");
  TORCH_CHECK(q.size(1) % k_codes.size(2) == 0, "decode_attention: heads");
  TORCH_CHECK(spans.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "decode_attention: int64 indices");
  auto qc = q.contiguous();
  auto sc = spans.contiguous();
  auto cc = ctx.contiguous();
  auto out = torch::empty_like(qc);
  const bool i8 = mode == I8;
  const float* al = attn::alibi_data(alibi_slopes, qc.size(1));
  const float cap = attn::softcap_value(options.softcap);
  if (qc.scalar_type() == at::kFloat) {
    if (i8) run<I8, float>(qc, k_codes, k_param, v_codes, v_param, sc, cc, scale, al, cap, window, out, isa);
    else run<U4, float>(qc, k_codes, k_param, v_codes, v_param, sc, cc, scale, al, cap, window, out, isa);
  } else if (qc.scalar_type() == at::kBFloat16) {
    if (i8) run<I8, at::BFloat16>(qc, k_codes, k_param, v_codes, v_param, sc, cc, scale, al, cap, window, out, isa);
    else run<U4, at::BFloat16>(qc, k_codes, k_param, v_codes, v_param, sc, cc, scale, al, cap, window, out, isa);
  } else {
    TORCH_CHECK(false, "decode_attention: fp32 or bf16 only");
  }
  return out;
}

void store_kv_quant(torch::Tensor k, torch::Tensor v, torch::Tensor k_codes, torch::Tensor k_param,
                    torch::Tensor v_codes, torch::Tensor v_param, torch::Tensor slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "store_kv: slots must be int64 [B]");
  const int64_t B = slots.size(0), KVH = k_codes.size(2);
  if (B == 0) return;
  TORCH_CHECK(KVH > 0 && k.numel() % (B * KVH) == 0, "store_kv: k rows do not match the cache");
  const int64_t D = k.numel() / (B * KVH);
  const int mode = check_quant_cache(k_codes, k_param, D, "store_kv");
  TORCH_CHECK(check_quant_cache(v_codes, v_param, D, "store_kv") == mode, "store_kv: K and V caches differ");
  auto kr = k.reshape({B, KVH * D});
  TORCH_CHECK(v.dim() == 2 && v.size(0) == B && v.size(1) == KVH * D && v.stride(1) == 1 && kr.stride(1) == 1,
              "store_kv: k/v rows must match the cache rows");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "store_kv: k and v dtypes differ");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t num_slots = k_codes.size(0) * k_codes.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < num_slots, "store_kv: slot ", sp[b], " outside the cache");
  auto* kcp = static_cast<uint8_t*>(k_codes.data_ptr());
  auto* vcp = static_cast<uint8_t*>(v_codes.data_ptr());
  float* kpp = k_param.data_ptr<float>();
  float* vpp = v_param.data_ptr<float>();
  auto both = [&](auto tag) {
    using T = decltype(tag);
    const T* ks = kr.data_ptr<T>();
    const T* vs = v.data_ptr<T>();
    if (mode == I8) {
      store_rows<I8, T>(ks, kr.stride(0), sp, B, KVH, D, kcp, kpp);
      store_rows<I8, T>(vs, v.stride(0), sp, B, KVH, D, vcp, vpp);
    } else {
      store_rows<U4, T>(ks, kr.stride(0), sp, B, KVH, D, kcp, kpp);
      store_rows<U4, T>(vs, v.stride(0), sp, B, KVH, D, vcp, vpp);
    }
  };
  if (k.scalar_type() == at::kFloat) both(float{});
  else if (k.scalar_type() == at::kBFloat16) both(at::BFloat16{});
  else TORCH_CHECK(false, "store_kv: fp32 or bf16 rows only");
}
