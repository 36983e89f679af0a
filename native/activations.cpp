// Gated MLP activations beside silu_mul (decode_steps.cpp); their shared row split is gated_rows.h.
//
// gelu_tanh_mul: a = gelu_tanh(g) * u for gate_up [T, 2I] (fp32 or bf16) -> [T, I], Gemma 2's MLP
// (`gelu_pytorch_tanh`: F.gelu(gate, approximate="tanh") * up), rounded like HF's two eager ops: gelu's output, then
// the product, each in the activation dtype. gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in fp32,
// the expression and order of ATen's CPU kernel; tanh is simd::tanh16 / tanh8 (a few ulp) or std::tanh (portable).
// For x << 0, 1 + tanh(..) cancels, as in ATen: the result's error is a few ulp of 0.5 |x|, not of gelu(x) (which
// is then tiny). Large |x| is safe: x^3 may reach inf, tanh(+-inf) = +-1, and gelu gives x or -0.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "gated_rows.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

constexpr float GELU_BETA = 0.7978845608028654f;   // sqrt(2 / pi)
constexpr float GELU_KAPPA = 0.044715f;

template <typename T>
inline float gelu_tanh_rounded(float x) {
  const float inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
  return static_cast<float>(static_cast<T>(0.5f * x * (1.f + std::tanh(inner))));
}

template <typename T>
void gelu_tanh_mul_scalar(const T* g, const T* u, int64_t n, T* o) {
  for (int64_t i = 0; i < n; ++i)
    o[i] = static_cast<T>(gelu_tanh_rounded<T>(static_cast<float>(g[i])) * static_cast<float>(u[i]));
}

// 16 / 8 lanes of gelu_tanh(g) rounded to T, times u
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
inline __m512 gelu_tanh_mul16(__m512 x, __m512 u) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 inner =
      _mm512_mul_ps(_mm512_set1_ps(GELU_BETA), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), x3)));
  const __m512 t = simd::tanh16(inner);
  const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.f), t));
  return _mm512_mul_ps(simd::round_to<T>(gelu), u);
}

template <typename T>
__attribute__((target("avx2,fma"), always_inline))
inline __m256 gelu_tanh_mul8(__m256 x, __m256 u) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner =
      _mm256_mul_ps(_mm256_set1_ps(GELU_BETA), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), x3)));
  const __m256 t = simd::tanh8(inner);
  const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.f), t));
  return _mm256_mul_ps(simd::round_to8<T>(gelu), u);
}

// The vector kernels do the last n % 16 (n % 8) elements as one more vector over a zero-padded copy, so every
// element of a row goes through the same arithmetic whatever its position or the split over threads.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void gelu_tanh_mul_avx512(const T* g, const T* u, int64_t n, T* o) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) simd::store16(o + i, gelu_tanh_mul16<T>(simd::load16(g + i), simd::load16(u + i)));
  if (i < n) {
    T gt[16] = {}, ut[16] = {}, ot[16];
    std::copy(g + i, g + n, gt);
    std::copy(u + i, u + n, ut);
    simd::store16(ot, gelu_tanh_mul16<T>(simd::load16(gt), simd::load16(ut)));
    std::copy(ot, ot + (n - i), o + i);
  }
}

template <typename T>
__attribute__((target("avx2,fma")))
void gelu_tanh_mul_avx2(const T* g, const T* u, int64_t n, T* o) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) simd::store8(o + i, gelu_tanh_mul8<T>(simd::load8(g + i), simd::load8(u + i)));
  if (i < n) {
    T gt[8] = {}, ut[8] = {}, ot[8];
    std::copy(g + i, g + n, gt);
    std::copy(u + i, u + n, ut);
    simd::store8(ot, gelu_tanh_mul8<T>(simd::load8(gt), simd::load8(ut)));
    std::copy(ot, ot + (n - i), o + i);
  }
}

// gelu_tanh_mul's kernels at each ISA level, for gated_rows.h
struct GeluTanh {
  template <typename T>
  static void run(int64_t isa, const T* g, const T* u, int64_t n, T* a) {
    if (isa >= 2) gelu_tanh_mul_avx512<T>(g, u, n, a);
    else if (isa == 1) gelu_tanh_mul_avx2<T>(g, u, n, a);
    else gelu_tanh_mul_scalar<T>(g, u, n, a);
  }
};

}  // namespace

torch::Tensor gelu_tanh_mul(torch::Tensor gate_up, int64_t isa) {
  return gated_mul<GeluTanh>(gate_up, isa, "gelu_tanh_mul");
}
