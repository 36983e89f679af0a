// The steps of a decoder layer on a decode-only batch (one new token per sequence): steps.h describes them.
// Each runs the kernels the unfused path calls, in the same order, so a step's output is bit-equal to the Python
// reference path's sequence on the same kernels; decode_stack.cpp chains them over all layers in one call.
//
// silu_mul: a = silu(g) * u for gate_up [T, 2I] -> [T, I], rounded like HF's two eager ops (silu's
// output, then the product, each in the activation dtype); silu(x) = x / (1 + e^-x), computed from
// e = exp(-|x|) so the exponential never overflows.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "gated_rows.h"
#include "kernels.h"
#include "op_profile.h"
#include "steps.h"
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

// the same with AVX2: without it an AVX2 CPU runs the scalar loop with std::exp, on one thread while the other
// waits (docs/performance.md, "Small decode kernels")
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

// silu_mul's kernels at each ISA level, for gated_rows.h
struct Silu {
  template <typename T>
  static void run(int64_t isa, const T* g, const T* u, int64_t n, T* a) {
    if (isa >= 2) silu_mul_avx512<T>(g, u, n, a);
    else if (isa == 1) silu_mul_avx2<T>(g, u, n, a);
    else silu_mul_scalar<T>(g, u, n, a);
  }
};

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa) { return gated_mul<Silu>(gate_up, isa, "silu_mul"); }

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

void AttentionStep::check() const {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "AttentionStep: num_heads and num_kv_heads must be > 0");
  TORCH_CHECK(k_param.has_value() == v_param.has_value(), "AttentionStep: params for both K and V or neither");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "AttentionStep: norms for both q and k or neither");
  TORCH_CHECK(k_cache.defined() && v_cache.defined() && k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads,
              "AttentionStep: the cache is not [S, P, ", num_kv_heads, ", D]");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "AttentionStep: heads ", num_heads, " not a multiple of KV heads ",
              num_kv_heads);
  TORCH_CHECK(rope_table >= 0, "AttentionStep: rope_table must be >= 0");
  options().check();
  for (const OptLora* l : {&qkv_lora, &o_lora})
    if (*l) (*l)->check();
  for (const Weight* w : {&qkv, &o})
    if (const auto* q = std::get_if<QuantWeight>(w)) q->check();
}

void MlpStep::check() const {
  for (const OptLora* l : {&gate_up_lora, &down_lora})
    if (*l) (*l)->check();
  for (const Weight* w : {&gate_up, &down})
    if (const auto* q = std::get_if<QuantWeight>(w)) q->check();
  TORCH_CHECK(activation == static_cast<int64_t>(Activation::Silu) ||
              activation == static_cast<int64_t>(Activation::GeluTanh), "MlpStep: unknown activation ", activation);
}

void NormStep::check() const {
  TORCH_CHECK(weight.defined() && weight.dim() == 1, "NormStep: the weight must be [H]");
  TORCH_CHECK(eps > 0, "NormStep: eps must be > 0");
}

std::tuple<torch::Tensor, std::optional<torch::Tensor>> norm_step(const torch::Tensor& x,
                                                                  const std::optional<torch::Tensor>& residual,
                                                                  const NormStep& n, int64_t isa) {
  if (!n.adds_residual) return {std::get<0>(rms_norm(x, n.weight, n.eps, std::nullopt, isa)), residual};
  // the sublayer's share scaled in x's dtype first, as the Python path does (ATen's mul by a scalar either way)
  const auto joined = residual && n.residual_scale != 1.0 ? x.mul(n.residual_scale) : x;
  auto [h, s] = rms_norm(joined, n.weight, n.eps, residual, isa);
  return {h, s};
}

torch::Tensor attention_step(const torch::Tensor& x, const AttentionStep& a, const DecodeRows& rows, int64_t isa,
                             int64_t native_rows, const LoraRows& lora) {
  TORCH_CHECK(x.dim() == 2, "attention_step: x must be [B, H]");
  TORCH_CHECK(!a.rotary || (rows.cos && rows.sin), "attention_step: a rotary step needs cos and sin rows");
  const int64_t B = x.size(0), heads = a.num_heads, kv_heads = a.num_kv_heads;
  auto qkv = allspark::timed("qkv_proj", [&] { return project(x, a.qkv, a.qkv_bias, isa, native_rows); });
  add_lora(qkv, x, a.qkv_lora, lora, isa, native_rows);
  // head dim (a uint4 cache row holds D / 2 bytes)
  const int64_t D = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D && (!a.rotary || rows.cos->size(-1) == D),
              "attention_step: qkv width");
  auto q = qkv.narrow(1, 0, heads * D).view({B, heads, D});
  auto k = qkv.narrow(1, heads * D, kv_heads * D).view({B, kv_heads, D});
  auto v = qkv.narrow(1, (heads + kv_heads) * D, kv_heads * D);
  if (a.q_norm) {   // each head's row normalized: [B * heads, D] (copies: the rows are strided views)
    allspark::OpTimer timer("qk_norm");
    q = std::get<0>(rms_norm(q.reshape({B * heads, D}), *a.q_norm, a.norm_eps, std::nullopt, isa)).view({B, heads, D});
    k = std::get<0>(rms_norm(k.reshape({B * kv_heads, D}), *a.k_norm, a.norm_eps, std::nullopt, isa))
            .view({B, kv_heads, D});
  }
  if (a.rotary) std::tie(q, k) = allspark::timed("rotary", [&] { return rotary(q, k, *rows.cos, *rows.sin, isa); });
  torch::Tensor o;
  if (a.k_param) {   // quantized spans (span_attention_quant.cpp)
    allspark::timed("kv_store",
                    [&] { store_kv_quant(k, v, a.k_cache, *a.k_param, a.v_cache, *a.v_param, rows.slots); });
    allspark::OpTimer timer("attention");
    o = decode_attention_quant(q, a.k_cache, *a.k_param, a.v_cache, *a.v_param, rows.spans, rows.ctx, a.options(),
                               isa, a.alibi_slopes);
  } else {
    allspark::timed("kv_store", [&] { store_kv(k, v, a.k_cache, a.v_cache, rows.slots); });
    allspark::OpTimer timer("attention");
    o = decode_attention(q, a.k_cache, a.v_cache, rows.spans, rows.ctx, a.options(), isa, a.alibi_slopes);
  }
  const auto attended = o.view({B, heads * D});
  auto out = allspark::timed("o_proj", [&] { return project(attended, a.o, std::nullopt, isa, native_rows); });
  add_lora(out, attended, a.o_lora, lora, isa, native_rows);
  return out;
}

torch::Tensor mlp_step(const torch::Tensor& x, const MlpStep& m, int64_t isa, int64_t native_rows,
                       const LoraRows& lora) {
  auto gate_up = allspark::timed("gate_up_proj",
                                 [&] { return project(x, m.gate_up, m.gate_up_bias, isa, native_rows); });
  add_lora(gate_up, x, m.gate_up_lora, lora, isa, native_rows);
  auto a = allspark::timed("act_mul", [&] {
    return m.activation == static_cast<int64_t>(Activation::Silu) ? silu_mul(gate_up, isa) : gelu_tanh_mul(gate_up, isa);
  });
  auto out = allspark::timed("down_proj", [&] { return project(a, m.down, std::nullopt, isa, native_rows); });
  add_lora(out, a, m.down_lora, lora, isa, native_rows);
  return out;
}
