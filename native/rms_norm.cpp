// Fused residual add + RMSNorm, the way HF Llama/Qwen2 compute it, in one pass per row:
//   s   = x + residual                      (rounded to the activation dtype, as HF's `residual + h`)
//   out = weight * dtype(s * rsqrt(mean(s^2) + eps))   (statistics and scaling in fp32)
// x, residual [T, H] and weight [H], all fp32 or all bf16. Returns (out, s); without a residual s = x.
// Rows are independent and split across torch's threads (one thread for a decode step's few rows).
#include <torch/extension.h>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "parallel.h"

namespace {

template <typename T>
void run(const T* x, const T* res, const T* w, int64_t rows, int64_t H, float eps, T* out, T* sum) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1));
  allspark::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> s(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res) {
          const T rounded = static_cast<T>(v + static_cast<float>(res[r * H + i]));
          sum[r * H + i] = rounded;
          v = static_cast<float>(rounded);
        }
        s[i] = v;
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += s[i] * s[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) {
        const float normed = static_cast<float>(static_cast<T>(s[i] * inv));
        o[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
      }
    }
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual) {
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
               out.data_ptr<float>(), sum.data_ptr<float>());
  } else if (xc.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(xc.data_ptr<at::BFloat16>(), residual ? rc.data_ptr<at::BFloat16>() : nullptr,
                      wc.data_ptr<at::BFloat16>(), rows, H, e, out.data_ptr<at::BFloat16>(),
                      sum.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "rms_norm: fp32 or bf16 only");
  }
  return {out, sum};
}
