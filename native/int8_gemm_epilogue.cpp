// The epilogue of the A8W8 prefill GEMM (ops.linear on CPUs with AMX int8: torch._int_mm of x rounded to int8 per row
// against int8 per-channel codes): y[m, n] = acc[m, n] * (d[m] * s[n]) (+ b[n]) in fp32, one rounding into the output
// dtype, AVX-512 / AVX2 / portable. kernels.h declares it; tests/kernels/test_quant_kernels.py checks it by hand.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {
// one element of the int8 GEMM's epilogue (scale_int_mm); the vector loops below compute the same, up to the one
// fp32 rounding an FMA saves where the compiler fuses the multiply and the add
template <typename O>
inline O scaled(int32_t acc, float d, float s, const float* b, int64_t n) {
  return static_cast<O>(static_cast<float>(acc) * (d * s) + (b ? b[n] : 0.f));
}

// rows [m0, m1) of the epilogue
template <typename O>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
void scale_rows_avx512(const int32_t* acc, const float* d, const float* s, const float* b, int64_t m0, int64_t m1,
                       int64_t N, O* y) {
  for (int64_t m = m0; m < m1; ++m) {
    const __m512 dm = _mm512_set1_ps(d[m]);
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      const __m512 a = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + m * N + n));
      const __m512 bv = b ? _mm512_loadu_ps(b + n) : _mm512_setzero_ps();
      simd::store16(y + m * N + n, _mm512_add_ps(_mm512_mul_ps(a, _mm512_mul_ps(dm, _mm512_loadu_ps(s + n))), bv));
    }
    for (; n < N; ++n) y[m * N + n] = scaled<O>(acc[m * N + n], d[m], s[n], b, n);
  }
}

template <typename O>
__attribute__((target("avx2,fma")))
void scale_rows_avx2(const int32_t* acc, const float* d, const float* s, const float* b, int64_t m0, int64_t m1,
                     int64_t N, O* y) {
  for (int64_t m = m0; m < m1; ++m) {
    const __m256 dm = _mm256_set1_ps(d[m]);
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + m * N + n)));
      const __m256 bv = b ? _mm256_loadu_ps(b + n) : _mm256_setzero_ps();
      simd::store8(y + m * N + n, _mm256_add_ps(_mm256_mul_ps(a, _mm256_mul_ps(dm, _mm256_loadu_ps(s + n))), bv));
    }
    for (; n < N; ++n) y[m * N + n] = scaled<O>(acc[m * N + n], d[m], s[n], b, n);
  }
}

template <typename O>
void scale_rows(const int32_t* acc, const float* d, const float* s, const float* b, int64_t M, int64_t N, O* y,
                int64_t isa) {
  allspark::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t m0, int64_t m1) {
    if (isa >= 2) return scale_rows_avx512(acc, d, s, b, m0, m1, N, y);
    if (isa >= 1) return scale_rows_avx2(acc, d, s, b, m0, m1, N, y);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] = scaled<O>(acc[m * N + n], d[m], s[n], b, n);
  });
}
}  // namespace

torch::Tensor scale_int_mm(const torch::Tensor& acc, const torch::Tensor& d, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& bias, at::ScalarType dtype, int64_t isa) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt, "scale_int_mm: acc must be int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(d.dim() == 1 && d.size(0) == M && d.scalar_type() == at::kFloat, "scale_int_mm: d must be fp32 [", M,
              "]");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == 1 && scales.scalar_type() == at::kHalf,
              "scale_int_mm: scales must be the fp16 per-channel scales [", N, ", 1]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "scale_int_mm: the result is fp32 or bf16");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "scale_int_mm: bias must be [", N, "]");
  const auto a = acc.contiguous(), dc = d.contiguous();
  const auto s = scales.reshape({N}).to(torch::kFloat).contiguous();
  const auto b = bias ? bias->to(torch::kFloat).contiguous() : torch::Tensor();
  auto y = torch::empty({M, N}, acc.options().dtype(dtype));
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat)
    scale_rows(a.data_ptr<int32_t>(), dc.data_ptr<float>(), s.data_ptr<float>(), bp, M, N, y.data_ptr<float>(), isa);
  else
    scale_rows(a.data_ptr<int32_t>(), dc.data_ptr<float>(), s.data_ptr<float>(), bp, M, N,
               y.data_ptr<at::BFloat16>(), isa);
  return y;
}
