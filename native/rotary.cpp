// Rotary embedding of q and k in one call, HF's formula and roundings:
//   out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
// each product and the sum rounded to the activation dtype, as the eager ops do.
// x [T, heads, D] (any strides with a contiguous last dim: q/k may be views into the fused qkv output),
// cos/sin [T, D] contiguous in the same dtype. Returns contiguous [T, heads, D] copies.
// isa 2 (AVX-512) with D a multiple of 32 rotates 16 lanes at a time with the same roundings; isa 1 (AVX2) with D
// a multiple of 16, 8 lanes: the elementwise loop was a visible part of each layer's decode step
// (docs/performance.md, "Choices in the code").
#include <torch/extension.h>
#include <tuple>

#include "parallel.h"
#include "simd.h"

namespace {

// one head row: the first half gets x1 * c - x2 * s, the second x2 * c + x1 * s (x1, x2 the halves).
// fp-contract off: for fp32 the compiler would otherwise fuse a product and the sum into one FMA, which
// rounds once where the eager ops round twice.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"), optimize("fp-contract=off")))
void rotate_row_avx512(const T* x, const T* c, const T* s, int64_t half, T* o) {
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 x1 = simd::load16(x + d), x2 = simd::load16(x + half + d);
    const __m512 a1 = simd::round_to<T>(_mm512_mul_ps(x1, simd::load16(c + d)));
    const __m512 b1 = simd::round_to<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), simd::load16(s + d)));
    simd::store16(o + d, _mm512_add_ps(a1, b1));
    const __m512 a2 = simd::round_to<T>(_mm512_mul_ps(x2, simd::load16(c + half + d)));
    const __m512 b2 = simd::round_to<T>(_mm512_mul_ps(x1, simd::load16(s + half + d)));
    simd::store16(o + half + d, _mm512_add_ps(a2, b2));
  }
}

template <typename T>
__attribute__((target("avx2,fma"), optimize("fp-contract=off")))
void rotate_row_avx2(const T* x, const T* c, const T* s, int64_t half, T* o) {
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 x1 = simd::load8(x + d), x2 = simd::load8(x + half + d);
    const __m256 a1 = simd::round_to8<T>(_mm256_mul_ps(x1, simd::load8(c + d)));
    const __m256 b1 = simd::round_to8<T>(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), simd::load8(s + d)));
    simd::store8(o + d, _mm256_add_ps(a1, b1));
    const __m256 a2 = simd::round_to8<T>(_mm256_mul_ps(x2, simd::load8(c + half + d)));
    const __m256 b2 = simd::round_to8<T>(_mm256_mul_ps(x1, simd::load8(s + half + d)));
    simd::store8(o + half + d, _mm256_add_ps(a2, b2));
  }
}

template <typename T>
void rotate(const torch::Tensor& x, const T* cos, const T* sin, torch::Tensor& out, int64_t isa) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * D, 1));
  allspark::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = xp + t * st + h * sh;
        T* o = op + (t * heads + h) * D;
        if (isa >= 2 && half % 16 == 0) {
          rotate_row_avx512<T>(xr, c, s, half, o);
          continue;
        }
        if (isa == 1 && half % 8 == 0) {
          rotate_row_avx2<T>(xr, c, s, half, o);
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -static_cast<float>(xr[d + half]) : static_cast<float>(xr[d - half]);
          const float a = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * static_cast<float>(c[d])));
          const float b = static_cast<float>(static_cast<T>(rot * static_cast<float>(s[d])));
          o[d] = static_cast<T>(a + b);
        }
      }
    }
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary: q/k shapes");
  TORCH_CHECK(q.size(2) % 2 == 0 && q.stride(2) == 1 && k.stride(2) == 1, "rotary: head dim must be even, contiguous");
  auto c = cos.reshape({q.size(0), q.size(2)}).contiguous();
  auto s = sin.reshape({q.size(0), q.size(2)}).contiguous();
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && c.scalar_type() == q.scalar_type() &&
              s.scalar_type() == q.scalar_type(), "rotary: q, k, cos and sin dtypes differ");
  auto qo = torch::empty(q.sizes(), q.options());
  auto ko = torch::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    rotate<float>(q, c.data_ptr<float>(), s.data_ptr<float>(), qo, isa);
    rotate<float>(k, c.data_ptr<float>(), s.data_ptr<float>(), ko, isa);
  } else if (q.scalar_type() == at::kBFloat16) {
    rotate<at::BFloat16>(q, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), qo, isa);
    rotate<at::BFloat16>(k, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), ko, isa);
  } else {
    TORCH_CHECK(false, "rotary: fp32 or bf16 only");
  }
  return {qo, ko};
}
