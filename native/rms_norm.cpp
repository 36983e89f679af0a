// Fused residual add + RMSNorm, the way HF Llama/Qwen2 compute it, in one pass per row:
//   s   = x + residual                      (rounded to the activation dtype, as HF's `residual + h`)
//   out = weight * dtype(s * rsqrt(mean(s^2) + eps))   (statistics and scaling in fp32)
// x, residual [T, H] and weight [H], all fp32 or all bf16. Returns (out, s); without a residual s = x.
// Rows are independent and split across torch's threads (one thread for a decode step's few rows).
// isa 2 (AVX-512) and 1 (AVX2) run 16 / 8 lanes at a time with the same roundings (the sum of squares in
// another order), because the portable loop's scalar bf16 conversions were a visible part of a decode step
// (docs/performance.md, "Choices in the code").
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

// one row: the sum s (also into `sum` when there is a residual) and the fp32 sum of its squares
template <typename T>
float sum_row_scalar(const T* x, const T* res, int64_t H, float* s, T* sum) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    float v = static_cast<float>(x[i]);
    if (res) {
      const T rounded = static_cast<T>(v + static_cast<float>(res[i]));
      sum[i] = rounded;
      v = static_cast<float>(rounded);
    }
    s[i] = v;
  }
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += s[i] * s[i];
  return ss;
}

template <typename T>
void scale_row_scalar(const float* s, const T* w, int64_t i0, int64_t H, float inv, T* o) {
  for (int64_t i = i0; i < H; ++i) {
    const float normed = static_cast<float>(static_cast<T>(s[i] * inv));
    o[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
  }
}

template <typename T>
__attribute__((target("avx2,fma")))
float sum_row_avx2(const T* x, const T* res, int64_t H, float* s, T* sum) {
  __m256 ss = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    __m256 v = simd::load8(x + i);
    if (res) {
      v = simd::round_to8<T>(_mm256_add_ps(v, simd::load8(res + i)));
      simd::store8(sum + i, v);
    }
    _mm256_storeu_ps(s + i, v);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  return simd::hsum8(ss) + sum_row_scalar<T>(x + i, res ? res + i : nullptr, H - i, s + i, sum + i);
}

template <typename T>
__attribute__((target("avx2,fma")))
void scale_row_avx2(const float* s, const T* w, int64_t H, float inv, T* o) {
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    simd::store8(o + i, _mm256_mul_ps(simd::load8(w + i), simd::round_to8<T>(_mm256_mul_ps(_mm256_loadu_ps(s + i), iv))));
  scale_row_scalar<T>(s, w, i, H, inv, o);
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
float sum_row_avx512(const T* x, const T* res, int64_t H, float* s, T* sum) {
  __m512 ss = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    __m512 v = simd::load16(x + i);
    if (res) {
      v = simd::round_to<T>(_mm512_add_ps(v, simd::load16(res + i)));
      simd::store16(sum + i, v);
    }
    _mm512_storeu_ps(s + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  return _mm512_reduce_add_ps(ss) + sum_row_scalar<T>(x + i, res ? res + i : nullptr, H - i, s + i, sum + i);
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void scale_row_avx512(const float* s, const T* w, int64_t H, float inv, T* o) {
  const __m512 iv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)
    simd::store16(o + i, _mm512_mul_ps(simd::load16(w + i), simd::round_to<T>(_mm512_mul_ps(_mm512_loadu_ps(s + i), iv))));
  scale_row_scalar<T>(s, w, i, H, inv, o);
}

template <typename T>
void run(const T* x, const T* res, const T* w, int64_t rows, int64_t H, float eps, T* out, T* sum, int64_t isa) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1));
  allspark::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> s(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* rr = res ? res + r * H : nullptr;
      T* sr = sum + r * H;
      const float ss = isa >= 2   ? sum_row_avx512<T>(x + r * H, rr, H, s.data(), sr)
                       : isa == 1 ? sum_row_avx2<T>(x + r * H, rr, H, s.data(), sr)
                                  : sum_row_scalar<T>(x + r * H, rr, H, s.data(), sr);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      if (isa >= 2) scale_row_avx512<T>(s.data(), w, H, inv, out + r * H);
      else if (isa == 1) scale_row_avx2<T>(s.data(), w, H, inv, out + r * H);
      else scale_row_scalar<T>(s.data(), w, 0, H, inv, out + r * H);
    }
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: shapes ", x.sizes(),
              " ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
  }
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto rc = residual ? residual->contiguous() : torch::Tensor();
  auto out = torch::empty_like(xc);
  auto sum = residual ? torch::empty_like(xc) : xc;
  const int64_t rows = xc.size(0), H = xc.size(1);
  const float e = static_cast<float>(eps);
  if (xc.scalar_type() == at::kFloat) {
    run<float>(xc.data_ptr<float>(), residual ? rc.data_ptr<float>() : nullptr, wc.data_ptr<float>(), rows, H, e,
               out.data_ptr<float>(), sum.data_ptr<float>(), isa);
  } else if (xc.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(xc.data_ptr<at::BFloat16>(), residual ? rc.data_ptr<at::BFloat16>() : nullptr,
                      wc.data_ptr<at::BFloat16>(), rows, H, e, out.data_ptr<at::BFloat16>(),
                      sum.data_ptr<at::BFloat16>(), isa);
  } else {
    TORCH_CHECK(false, "rms_norm: fp32 or bf16 only");
  }
  return {out, sum};
}
