// Rounding x for the quantized linear layers (gemv_quant.cpp has the arithmetic that needs it): each row of x
// to 16-bit (weight-only) or 8-bit (activate_quant) fixed point, q = round(x * act_max / absmax) half to even
// with d = absmax / act_max, the same on every ISA, so every kernel equals ops.linear_reference up to fp32
// summation order.
//   round_activations: q laid out as each GEMV kernel reads it (gemv_quant.h: Layout), with the block, chunk and
//     group sums the kernels take the zero points off with; for the batch-1..16 GEMVs.
//   round_rows: q * d back in fp32 or bf16, bit-equal to ops.round_activations_reference; the x of a dequantized
//     activate_quant GEMM (prefill, decode batches above the GEMV's 16 rows).
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

namespace qgemv {
namespace {

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

}  // namespace

// a zero row: inv 0; the largest magnitude is exact at every ISA level (a NaN element skipped by all three), so
// every level agrees
RowScale row_scale(const float* x, int64_t K, float act_max, int64_t isa) {
  const float amax = isa >= 2 ? abs_max_avx512(x, K) : isa >= 1 ? abs_max_avx2(x, K) : abs_max(x, K);
  return {amax > 0.f ? act_max / amax : 0.f, amax / act_max};
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

namespace {

// bf16 -> fp32 (exact: the bits moved up 16)
__attribute__((target("avx2,fma,f16c")))
void widen_bf16_avx2(const at::BFloat16* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, simd::load8(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
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

}  // namespace

void widen_bf16(const at::BFloat16* x, int64_t n, float* out, int64_t isa) {
  if (isa >= 1) return widen_bf16_avx2(x, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// the same arithmetic on every ISA: one multiply by act_max / absmax (32767; 127 for activate_quant, whose q
// then fit int8: stored as bytes for the NIBBLES8 / BYTES8 / NIBBLES8W kernels), round half to even (PAIRS /
// NIBBLES / NIBBLES8W: only for the AVX-512 kernel, isa >= 3); `group`: the weight's group size (NIBBLES16 /
// NIBBLES8: group sums)
Act16 round_activations(const float* x, int64_t M, int64_t K, int64_t isa, float act_max, Layout layout, int64_t group) {
  Act16 a;
  const bool avx512 = layout == PAIRS || layout == NIBBLES || layout == NIBBLES8W;
  const bool nibbles = layout == NIBBLES16 || layout == NIBBLES8;
  const bool bytes = layout == NIBBLES8 || layout == BYTES8 || layout == NIBBLES8W;   // q8 instead of q
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
    const auto [inv, d] = row_scale(xm, K, act_max, isa);
    a.d[m] = d;
    int16_t* q = bytes ? nullptr : a.q.data() + m * a.padded;
    int32_t* bsum = a.block_sum.data() + m * nb;
    if (avx512) {
      round_row_avx512(xm, K, a.padded, inv, layout, q, bytes ? a.q8.data() + m * a.padded : nullptr, bsum,
                       a.chunk_sum.data() + m * nb / 16);
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

namespace {
// f(m, row m of x in fp32) for every row, rows split over the threads (bf16 rows widened into a buffer of the thread)
template <typename X, typename F>
void for_rows_in_fp32(const X* x, int64_t M, int64_t K, int64_t isa, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (4 * std::max<int64_t>(K, 1)));
  allspark::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> widened(std::is_same_v<X, float> ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      if constexpr (std::is_same_v<X, float>) {
        f(m, x + m * K);
      } else {
        widen_bf16(x + m * K, K, widened.data(), isa);
        f(m, static_cast<const float*>(widened.data()));
      }
    }
  });
}

template <typename X, typename T>
void round_rows_of(const X* x, int64_t M, int64_t K, float act_max, T* y, int64_t isa) {
  for_rows_in_fp32(x, M, K, isa, [&](int64_t m, const float* xm) {
    const auto [inv, d] = row_scale(xm, K, act_max, isa);
    T* ym = y + m * K;
    if (isa >= 2) scale_row_avx512(xm, K, inv, d, ym);
    else if (isa >= 1) scale_row_avx2(xm, K, inv, d, ym);
    else for (int64_t k = 0; k < K; ++k) ym[k] = static_cast<T>(std::nearbyint(xm[k] * inv) * d);
  });
}

// each row as int8 codes q (act_max 127) and its d
template <typename X>
void quantize_rows_int8_of(const X* x, int64_t M, int64_t K, int8_t* q, float* d, int64_t isa) {
  for_rows_in_fp32(x, M, K, isa, [&](int64_t m, const float* xm) {
    thread_local std::vector<int16_t> r;
    r.resize(K);
    const auto [inv, dm] = row_scale(xm, K, 127.f, isa);
    d[m] = dm;
    if (isa >= 1) round_row_avx2(xm, K, inv, r.data());
    else for (int64_t k = 0; k < K; ++k) r[k] = static_cast<int16_t>(std::nearbyint(xm[k] * inv));
    for (int64_t k = 0; k < K; ++k) q[m * K + k] = static_cast<int8_t>(r[k]);   // |r| <= 127
  });
}
}  // namespace
}  // namespace qgemv

std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(const torch::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows_int8: x must be 2-D, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantize_rows_int8: x must be fp32 or bf16");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, xc.options().dtype(torch::kChar));
  auto d = torch::empty({M}, xc.options().dtype(torch::kFloat));
  if (xc.scalar_type() == at::kFloat)
    qgemv::quantize_rows_int8_of(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), isa);
  else
    qgemv::quantize_rows_int8_of(xc.data_ptr<at::BFloat16>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), isa);
  return {q, d};
}

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
    if (dtype == at::kFloat) qgemv::round_rows_of(xp, M, K, a, y.data_ptr<float>(), isa);
    else qgemv::round_rows_of(xp, M, K, a, y.data_ptr<at::BFloat16>(), isa);
  };
  if (xc.scalar_type() == at::kFloat) run(xc.data_ptr<float>());
  else run(xc.data_ptr<at::BFloat16>());
  return y;
}

