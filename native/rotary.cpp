// Rotary embedding of q and k in one call, HF's formula and roundings:
//   out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
// each product and the sum rounded to the activation dtype, as the eager ops do.
// x [T, heads, D] (any strides with a contiguous last dim: q/k may be views into the fused qkv output),
// cos/sin [T, D] contiguous in the same dtype. Returns contiguous [T, heads, D] copies.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tuple>

namespace {

template <typename T>
void rotate(const torch::Tensor& x, const T* cos, const T* sin, torch::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * D, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = xp + t * st + h * sh;
        T* o = op + (t * heads + h) * D;
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
                                                torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary: q/k shapes");
  TORCH_CHECK(q.size(2) % 2 == 0 && q.stride(2) == 1 && k.stride(2) == 1, "rotary: head dim must be even, contiguous");
  auto c = cos.reshape({q.size(0), q.size(2)}).contiguous();
  auto s = sin.reshape({q.size(0), q.size(2)}).contiguous();
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && c.scalar_type() == q.scalar_type() &&
              s.scalar_type() == q.scalar_type(), "rotary: q, k, cos and sin dtypes differ");
  auto qo = torch::empty(q.sizes(), q.options());
  auto ko = torch::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    rotate<float>(q, c.data_ptr<float>(), s.data_ptr<float>(), qo);
    rotate<float>(k, c.data_ptr<float>(), s.data_ptr<float>(), ko);
  } else if (q.scalar_type() == at::kBFloat16) {
    rotate<at::BFloat16>(q, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), qo);
    rotate<at::BFloat16>(k, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), ko);
  } else {
    TORCH_CHECK(false, "rotary: fp32 or bf16 only");
  }
  return {qo, ko};
}
