// Fused decode blocks. When every sequence of a step decodes one token, each half of a decoder layer is
// one call, so the Python and dispatcher work between the kernels (about 100 us per layer, measured on a
// 0.5 B model) is gone; the kernels themselves are the ones the unfused path calls.
//
//   attention block: s = x + residual; h = RMSNorm(s); q|k|v = h . W_qkv^T (+ b); [q, k = RMSNorm per head
//                    with q_norm, k_norm (Qwen3)]; rotate q, k [unless cos/sin are None: ALiBi models,
//                    whose alibi_slopes the attention adds];
//                    write k, v into their cache slots; o = attention over each sequence's spans;
//                    returns (o . W_o^T, s)            -- before the tensor-parallel allreduce and o bias
//   mlp block:       s = x + residual; h = RMSNorm(s); g|u = h . W_gu^T (+ b); a = silu(g) * u;
//                    returns (a . W_down^T, s)         -- before the allreduce and down bias
//
// x, residual [B, H]; caches [S, P, KVH, D] (or quantized codes with their params, span_attention_quant.cpp); slots [B] int64 (cache slot of each new token); spans, ctx
// as in span_attention.cpp; cos/sin [B, 1, D]. The projection weights are dense or quantized (`Weight`);
// `project` (gemv_quant.cpp) picks the native GEMV for few rows and ATen's GEMM otherwise, the same rule
// as ops.linear.
//
// silu_mul: a = silu(g) * u for gate_up [T, 2I] -> [T, I], rounded like HF's two eager ops (silu's
// output, then the product, each in the activation dtype); silu(x) = x / (1 + e^-x), computed from
// e = exp(-|x|) so the exponential never overflows.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

template <typename T>
inline float silu_rounded(float x) {
  const float e = std::exp(-std::fabs(x));
  const float s = (x < 0.f ? x * e : x) / (1.f + e);
  return static_cast<float>(static_cast<T>(s));
}

template <typename T>
void silu_mul_scalar(const T* g, const T* u, int64_t n, T* o) {
  for (int64_t i = 0; i < n; ++i)
    o[i] = static_cast<T>(silu_rounded<T>(static_cast<float>(g[i])) * static_cast<float>(u[i]));
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void silu_mul_avx512(const T* g, const T* u, int64_t n, T* o) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = simd::load16(g + i);
    const __m512 ax = _mm512_abs_ps(x);
    // exp_nonpositive clamps at -87; beyond it e^-|x| is below fp32's normal range: take it as 0
    const __m512 e = _mm512_mask_mov_ps(simd::exp_nonpositive(_mm512_sub_ps(zero, ax)),
                                        _mm512_cmp_ps_mask(ax, _mm512_set1_ps(87.f), _CMP_GT_OQ), zero);
    const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
    __m512 s = _mm512_div_ps(_mm512_mask_mul_ps(x, negative, x, e), _mm512_add_ps(one, e));
    simd::store16(o + i, _mm512_mul_ps(simd::round_to<T>(s), simd::load16(u + i)));
  }
  silu_mul_scalar(g + i, u + i, n - i, o + i);
}

// the same with AVX2 (measured in a batch-1 decode profile on the Zen 3-class AVX2 VM, where the scalar loop with
// std::exp ran instead: 2% of all samples of a 4-bit 0.5 B model's decode, on one thread while the other waited)
template <typename T>
__attribute__((target("avx2,fma")))
void silu_mul_avx2(const T* g, const T* u, int64_t n, T* o) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = simd::load8(g + i);
    const __m256 ax = _mm256_and_ps(x, magnitude);
    // as silu_mul_avx512: beyond -87, e^-|x| is taken as 0
    const __m256 e = _mm256_blendv_ps(simd::exp_nonpositive8(_mm256_sub_ps(zero, ax)), zero,
                                      _mm256_cmp_ps(ax, _mm256_set1_ps(87.f), _CMP_GT_OQ));
    const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
    const __m256 s = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
    simd::store8(o + i, _mm256_mul_ps(simd::round_to8<T>(s), simd::load8(u + i)));
  }
  silu_mul_scalar(g + i, u + i, n - i, o + i);
}

// Rows are cut into pieces of SILU_PIECE columns, so a decode step's one row of 4096+ also runs on every thread
// (measured on the AVX2 VM: one 4096-wide row on one thread took 27-32 us in a decode step, the gate half
// written by one thread's GEMV rows and the up half by the other's). Pieces start at multiples of 16, so which
// elements the vector loops leave to the scalar tail (the row's last I % 8 or I % 16) does not depend on the
// split.
constexpr int64_t SILU_PIECE = 512;

template <typename T>
void silu_mul_rows(const torch::Tensor& gu, torch::Tensor& out, int64_t isa) {
  const int64_t rows = gu.size(0), I = out.size(1);
  const int64_t pieces = (I + SILU_PIECE - 1) / SILU_PIECE;
  const T* g = gu.data_ptr<T>();
  T* o = out.data_ptr<T>();
  allspark::parallel_for(0, rows * pieces, std::max<int64_t>(1, 2048 / SILU_PIECE), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / pieces, c0 = p % pieces * SILU_PIECE, n = std::min(SILU_PIECE, I - c0);
      const T* gate = g + r * 2 * I + c0;
      const T* up = gate + I;
      T* a = o + r * I + c0;
      if (isa >= 2) silu_mul_avx512<T>(gate, up, n, a);
      else if (isa == 1) silu_mul_avx2<T>(gate, up, n, a);
      else silu_mul_scalar<T>(gate, up, n, a);
    }
  });
}

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [T, 2I]");
  auto gu = gate_up.contiguous();
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == at::kFloat) silu_mul_rows<float>(gu, out, isa);
  else if (gu.scalar_type() == at::kBFloat16) silu_mul_rows<at::BFloat16>(gu, out, isa);
  else TORCH_CHECK(false, "silu_mul: fp32 or bf16 only");
  return out;
}

// k [B, KVH, D] and v [B, KVH * D] (rows may be strided, e.g. views into the qkv output) -> their slots
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "store_kv: caches must be contiguous and alike");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "store_kv: dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "store_kv: slots must be int64 [B]");
  const int64_t B = slots.size(0);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  auto kc = k.reshape({B, row});
  TORCH_CHECK(v.dim() == 2 && v.size(0) == B && v.size(1) == row && v.stride(1) == 1 && kc.stride(1) == 1,
              "store_kv: k/v rows must match the cache rows");
  const int64_t elt = k_cache.element_size();
  const int64_t* sp = slots.contiguous().data_ptr<int64_t>();
  char* kdst = static_cast<char*>(k_cache.data_ptr());
  char* vdst = static_cast<char*>(v_cache.data_ptr());
  const char* ksrc = static_cast<const char*>(kc.data_ptr());
  const char* vsrc = static_cast<const char*>(v.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < num_slots, "store_kv: slot ", sp[b], " outside the cache");
    std::memcpy(kdst + sp[b] * row * elt, ksrc + b * kc.stride(0) * elt, row * elt);
    std::memcpy(vdst + sp[b] * row * elt, vsrc + b * v.stride(0) * elt, row * elt);
  }
}

std::tuple<torch::Tensor, torch::Tensor> decode_attention_block(
    torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_weight, double eps,
    Weight qkv_weight, std::optional<torch::Tensor> qkv_bias, int64_t num_heads, int64_t num_kv_heads,
    std::optional<torch::Tensor> cos, std::optional<torch::Tensor> sin, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor slots,
    torch::Tensor spans, torch::Tensor ctx, double scale, Weight o_weight, int64_t isa, int64_t native_rows,
    std::optional<torch::Tensor> k_param, std::optional<torch::Tensor> v_param, std::optional<torch::Tensor> q_norm,
    std::optional<torch::Tensor> k_norm, std::optional<torch::Tensor> alibi_slopes) {
  TORCH_CHECK(k_param.has_value() == v_param.has_value(), "decode_attention_block: params for both K and V or neither");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_attention_block: norms for both q and k or neither");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "decode_attention_block: cos and sin, or neither (no rotary)");
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads, "decode_attention_block: shapes");
  const int64_t B = x.size(0);
  auto [h, s] = rms_norm(x, norm_weight, eps, residual, isa);
  auto qkv = project(h, qkv_weight, qkv_bias, isa, native_rows);
  // head dim (a uint4 cache row holds D / 2 bytes)
  const int64_t D = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D && (!cos || cos->size(-1) == D),
              "decode_attention_block: qkv width");
  auto q = qkv.narrow(1, 0, num_heads * D).view({B, num_heads, D});
  auto k = qkv.narrow(1, num_heads * D, num_kv_heads * D).view({B, num_kv_heads, D});
  auto v = qkv.narrow(1, (num_heads + num_kv_heads) * D, num_kv_heads * D);
  if (q_norm) {   // each head's row normalized: [B * heads, D] (copies: the rows are strided views)
    q = std::get<0>(rms_norm(q.reshape({B * num_heads, D}), *q_norm, eps, std::nullopt, isa)).view({B, num_heads, D});
    k = std::get<0>(rms_norm(k.reshape({B * num_kv_heads, D}), *k_norm, eps, std::nullopt, isa)).view({B, num_kv_heads, D});
  }
  torch::Tensor qr = q, kr = k;   // no rotary (ALiBi): q and k as projected
  if (cos) std::tie(qr, kr) = rotary(q, k, *cos, *sin, isa);
  torch::Tensor o;
  if (k_param) {   // quantized spans (span_attention_quant.cpp)
    store_kv_quant(kr, v, k_cache, *k_param, v_cache, *v_param, slots);
    o = decode_attention_quant(qr, k_cache, *k_param, v_cache, *v_param, spans, ctx, scale, isa, alibi_slopes);
  } else {
    store_kv(kr, v, k_cache, v_cache, slots);
    o = decode_attention(qr, k_cache, v_cache, spans, ctx, scale, isa, alibi_slopes);
  }
  return {project(o.view({B, num_heads * D}), o_weight, std::nullopt, isa, native_rows), s};
}

std::tuple<torch::Tensor, torch::Tensor> decode_mlp_block(
    torch::Tensor x, torch::Tensor residual, torch::Tensor norm_weight, double eps, Weight gate_up_weight,
    std::optional<torch::Tensor> gate_up_bias, Weight down_weight, int64_t isa, int64_t native_rows) {
  auto [h, s] = rms_norm(x, norm_weight, eps, residual, isa);
  auto a = silu_mul(project(h, gate_up_weight, gate_up_bias, isa, native_rows), isa);
  return {project(a, down_weight, std::nullopt, isa, native_rows), s};
}
