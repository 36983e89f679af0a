// Quantized linear for decode: y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias), and the dequantization
// of a whole weight for prefill (then ATen's GEMM runs on it).
//
// Layout (allspark_server/quant/formats.py writes it; that file's `dequantize` is the reference):
//   qweight  int8 [N, K] (format 0, int8) | uint8 [N, K] (1, uint8) | uint8 [N, K/2] (2 int4, 3 uint4)
//   scales   fp16 [N, K/G]; zeros uint8 [N, K/G] for uint8/uint4 (int4's zero is 8, int8's 0)
//   4-bit: per block of 32 k, byte j holds k = j (low nibble) and k = 16 + j (high nibble).
// Weight-only math ("A16W8 / A16W4"): activations stay in fp32, each group's codes are widened to fp32 and
// met with FMAs, the group's scale applied once to its partial sum:
//   y = sum_g s_g * (sum_{k in g} x_k c_k  -  z_g * sum_{k in g} x_k)
// (the per-group sums of x are computed once per call). Results equal the dequantize-then-matmul
// reference up to fp32 rounding; one rounding into the activation dtype at the end, bias included.
//
// Why fp32 FMAs rather than int8 activations with integer dot products (llama.cpp's q8_0 . q8_0): decode
// at batch 1 is bound by the weight bytes streamed, and widening 32 codes costs ~10 vector instructions per
// 32 weights, which keeps up with the memory on these machines (benchmarks/ has the numbers); the integer
// path would add an activation rounding the reference does not have.
//
// ISA (chosen by ops.py): >= 1 AVX2+FMA+F16C (also used on AVX-512 machines), 0 portable C++. The weight
// streams row by row; each thread owns a contiguous block of rows, up to 4 rows of x share each decoded
// block of codes.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace {

constexpr int64_t MR = 4;      // x rows sharing each decoded block
constexpr int64_t BLOCK = 32;  // k per decoded block

enum Format : int64_t { INT8 = 0, UINT8 = 1, INT4 = 2, UINT4 = 3 };

inline float half_to_float(at::Half h) { return static_cast<float>(h); }

// ---- portable ---------------------------------------------------------------------------------
template <int F>
inline float code_at(const uint8_t* row, int64_t k) {
  if constexpr (F == INT8) return static_cast<float>(static_cast<int8_t>(row[k]));
  else if constexpr (F == UINT8) return static_cast<float>(row[k]);
  else {
    const uint8_t b = row[(k / BLOCK) * (BLOCK / 2) + (k % BLOCK) % (BLOCK / 2)];
    return static_cast<float>((k % BLOCK) < BLOCK / 2 ? (b & 0xF) : (b >> 4));
  }
}

template <int F>
inline float zero_of(const uint8_t* zeros_row, int64_t g) {
  if constexpr (F == UINT8 || F == UINT4) return static_cast<float>(zeros_row[g]);
  else if constexpr (F == INT4) return 8.f;
  else return 0.f;
}

template <int F>
void rows_scalar(const float* x, const float* xsum, int64_t M, int64_t K, const QuantView& w, int64_t n0, int64_t n1,
                 float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        float acc = 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) acc += x[m * K + k] * code_at<F>(wr, k);
        const float s = half_to_float(w.scales[n * w.groups + g]);
        total += s * (acc - zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g) * xsum[m * w.groups + g]);
      }
      y[m * N + n] = total;
    }
  }
}

// ---- AVX2 -------------------------------------------------------------------------------------
__attribute__((target("avx2,fma,f16c")))
inline __m256 widen8(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// the 32 codes of block [k, k + 32) as four fp32 vectors
template <int F>
__attribute__((target("avx2,fma,f16c")))
inline void codes32(const uint8_t* row, int64_t k, __m256 v[4]) {
  if constexpr (F == INT4 || F == UINT4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
    if constexpr (F == INT8) {
      v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
      v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
      v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
      v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
    } else {
      v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b0));
      v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b0, 8)));
      v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b1));
      v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b1, 8)));
    }
  }
}

__attribute__((target("avx2,fma,f16c")))
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// one weight row n against MB rows of x
template <int F, int MB>
__attribute__((target("avx2,fma,f16c")))
void row_avx2(const float* x, const float* xsum, int64_t K, const QuantView& w, int64_t n, float* y, int64_t N) {
  const uint8_t* wr = w.codes + n * w.row_bytes;
  const at::Half* sr = w.scales + n * w.groups;
  const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  __m256 total[MB];
  float correction[MB];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps(), correction[m] = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t k0 = g * G;
    __m256 acc[MB][2];
    float tail[MB];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps(), tail[m] = 0.f;
    int64_t k = k0;
    for (; k < k0 + G32; k += BLOCK) {
      if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + (F >= INT4 ? k / 2 : k) + 512), _MM_HINT_T0);
      __m256 v[4];
      codes32<F>(wr, k, v);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * K + k;
        acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), v[0], acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), v[1], acc[m][1]);
        acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), v[2], acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), v[3], acc[m][1]);
      }
    }
    if constexpr (F == INT8 || F == UINT8) {   // per-channel 8-bit weights: K need not be a multiple of 32
      for (; k + 8 <= k0 + G; k += 8) {
        const __m256 v = widen8(wr + k, F == INT8);
        for (int m = 0; m < MB; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), v, acc[m][0]);
      }
      for (; k < k0 + G; ++k)
        for (int m = 0; m < MB; ++m) tail[m] += x[m * K + k] * code_at<F>(wr, k);
    }
    const float s = _cvtsh_ss(sr[g].x);
    const float z = F == INT8 ? 0.f : F == INT4 ? 8.f : static_cast<float>(zr[g]);
    for (int m = 0; m < MB; ++m) {
      total[m] = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_add_ps(acc[m][0], acc[m][1]), total[m]);
      correction[m] += s * (tail[m] - z * xsum[m * w.groups + g]);
    }
  }
  for (int m = 0; m < MB; ++m) y[m * N + n] = hsum(total[m]) + correction[m];
}

template <int F>
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const float* x, const float* xsum, int64_t M, int64_t K, const QuantView& w, int64_t n0, int64_t n1,
               float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += MR) {
    const float* xm = x + m * K;
    const float* sm = xsum + m * w.groups;
    float* ym = y + m * N;
    for (int64_t n = n0; n < n1; ++n) {
      switch (std::min(MR, M - m)) {
        case 1: row_avx2<F, 1>(xm, sm, K, w, n, ym, N); break;
        case 2: row_avx2<F, 2>(xm, sm, K, w, n, ym, N); break;
        case 3: row_avx2<F, 3>(xm, sm, K, w, n, ym, N); break;
        default: row_avx2<F, 4>(xm, sm, K, w, n, ym, N); break;
      }
    }
  }
}

template <int F>
void rows(const float* x, const float* xsum, int64_t M, int64_t K, const QuantView& w, int64_t n0, int64_t n1,
          float* y, int64_t N, int64_t isa) {
  if (isa >= 1) rows_avx2<F>(x, xsum, M, K, w, n0, n1, y, N);
  else rows_scalar<F>(x, xsum, M, K, w, n0, n1, y, N);
}

// ---- dequantization (prefill) -------------------------------------------------------------------
__attribute__((target("avx2,fma,f16c")))
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
__attribute__((target("avx2,fma,f16c")))
inline void store8(at::BFloat16* p, __m256 v) {   // round to nearest even, as static_cast<BFloat16> does
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

template <int F, typename T>
__attribute__((target("avx2,fma,f16c")))
void dequantize_rows_avx2(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out) {
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = _cvtsh_ss(w.scales[n * w.groups + g].x);
      const float z = F == INT8 ? 0.f : F == INT4 ? 8.f : static_cast<float>(w.zeros[n * w.groups + g]);
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
      int64_t k = g * G;
      for (; k < g * G + G32; k += BLOCK) {
        __m256 v[4];
        codes32<F>(wr, k, v);
        for (int i = 0; i < 4; ++i) store8(out + n * K + k + 8 * i, _mm256_mul_ps(_mm256_sub_ps(v[i], zv), sv));
      }
      for (; k < (g + 1) * G; ++k) out[n * K + k] = static_cast<T>((code_at<F>(wr, k) - z) * s);
    }
  }
}

template <int F, typename T>
void dequantize_rows(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out, int64_t isa) {
  if (isa >= 1) return dequantize_rows_avx2<F, T>(w, K, n0, n1, out);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / w.group;
      const float z = zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g);
      out[n * K + k] = static_cast<T>((code_at<F>(wr, k) - z) * half_to_float(w.scales[n * w.groups + g]));
    }
  }
}

#define DISPATCH_FORMAT(fmt, ...)                        \
  switch (fmt) {                                         \
    case INT8: { constexpr int F = INT8; __VA_ARGS__; break; }   \
    case UINT8: { constexpr int F = UINT8; __VA_ARGS__; break; } \
    case INT4: { constexpr int F = INT4; __VA_ARGS__; break; }   \
    default: { constexpr int F = UINT4; __VA_ARGS__; break; }    \
  }

template <typename O>
void run_linear(const float* x, int64_t M, int64_t K, const QuantView& w, const O* bias, O* out, int64_t isa) {
  const int64_t N = w.rows;
  std::vector<float> xsum(M * w.groups, 0.f);   // per row of x and group: sum of x over the group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * w.groups + k / w.group] += x[m * K + k];
  std::vector<float> scratch(std::is_same_v<O, float> ? 0 : M * N);
  float* y = std::is_same_v<O, float> ? reinterpret_cast<float*>(out) : scratch.data();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(w.row_bytes, 1));   // ~64 KiB per task
  allspark::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    DISPATCH_FORMAT(w.format, rows<F>(x, xsum.data(), M, K, w, n0, n1, y, N, isa));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n)
        out[m * N + n] = static_cast<O>(y[m * N + n] + (bias ? static_cast<float>(bias[n]) : 0.f));
  });
}

}  // namespace

QuantView QuantWeight::view() const {
  QuantView v;
  v.codes = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  v.scales = scales.data_ptr<at::Half>();
  v.zeros = zeros ? zeros->data_ptr<uint8_t>() : nullptr;
  v.format = format;
  v.rows = qweight.size(0);
  v.row_bytes = qweight.size(1);
  v.groups = scales.size(1);
  v.group = in_features / v.groups;
  return v;
}

void QuantWeight::check() const {
  TORCH_CHECK(format >= INT8 && format <= UINT4, "QuantWeight: unknown format ", format);
  const bool four = format >= INT4;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == (format == INT8 ? at::kChar : at::kByte),
              "QuantWeight: qweight must be contiguous 2-D ", format == INT8 ? "int8" : "uint8");
  TORCH_CHECK(qweight.size(1) == (four ? in_features / 2 : in_features), "QuantWeight: qweight has ",
              qweight.size(1), " columns for ", in_features, " input features");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.size(0) == qweight.size(0) && scales.size(1) >= 1 && in_features % scales.size(1) == 0,
              "QuantWeight: scales must be fp16 [N, groups] with groups dividing K");
  const int64_t group = in_features / scales.size(1);
  TORCH_CHECK(!four || (in_features % BLOCK == 0 && (scales.size(1) == 1 || group % BLOCK == 0)),
              "QuantWeight: 4-bit weights need K and the group size to be multiples of 32");
  TORCH_CHECK(scales.size(1) == 1 || group % BLOCK == 0, "QuantWeight: group sizes are multiples of 32");
  const bool has_zeros = format == UINT8 || format == UINT4;
  TORCH_CHECK(has_zeros == zeros.has_value(), "QuantWeight: zeros are given exactly for uint8/uint4");
  if (zeros)
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "QuantWeight: zeros must be uint8 shaped like scales");
}

torch::Tensor linear_quant(torch::Tensor x, const QuantWeight& w, std::optional<torch::Tensor> bias, int64_t isa) {
  w.check();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_features, "linear_quant: x ", x.sizes(), " for K = ", w.in_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_quant: x fp32 or bf16");
  const QuantView v = w.view();
  const int64_t M = x.size(0), K = w.in_features, N = v.rows;
  if (bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                bias->scalar_type() == x.scalar_type(), "linear_quant: bias must be [N] in x's dtype");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xf = x.to(torch::kFloat).contiguous();   // x in fp32 once, shared by every weight row
  if (x.scalar_type() == at::kFloat)
    run_linear<float>(xf.data_ptr<float>(), M, K, v, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                      isa);
  else
    run_linear<at::BFloat16>(xf.data_ptr<float>(), M, K, v, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                             y.data_ptr<at::BFloat16>(), isa);
  return y;
}

torch::Tensor dequantize_weight(const QuantWeight& w, at::ScalarType dtype, int64_t isa) {
  w.check();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_weight: fp32 or bf16 output");
  const QuantView v = w.view();
  const int64_t K = w.in_features;
  auto out = torch::empty({v.rows, K}, torch::TensorOptions().dtype(dtype));
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(v.row_bytes, 1));
  allspark::parallel_for(0, v.rows, grain, [&](int64_t n0, int64_t n1) {
    if (dtype == at::kFloat) {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, float>(v, K, n0, n1, out.data_ptr<float>(), isa));
    } else {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, at::BFloat16>(v, K, n0, n1, out.data_ptr<at::BFloat16>(), isa));
    }
  });
  return out;
}

torch::Tensor project(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b, int64_t isa,
                      int64_t native_rows) {
  if (const auto* q = std::get_if<QuantWeight>(&w)) {
    if (x.size(0) <= QUANT_NATIVE_MAX_ROWS) return linear_quant(x, *q, b, isa);
    return at::linear(x, dequantize_weight(*q, x.scalar_type(), isa), b);
  }
  const auto& dense = std::get<torch::Tensor>(w);
  if (x.size(0) <= native_rows) return linear_small_m(x, dense, b, isa);
  return at::linear(x, dense, b);
}
