// Quantized linear for decode: y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias), and the dequantization
// of a whole weight for prefill (then ATen's GEMM runs on it).
//
// Layout (allspark_server/quant/formats.py writes it; that file's `dequantize` is the reference):
//   qweight  int8 [N, K] (format 0, int8) | uint8 [N, K] (1, uint8) | uint8 [N, K/2] (2 int4, 3 uint4, 4 uint4_min)
//   scales   fp16 [N, K/G]; zeros uint8 [N, K/G] for uint8/uint4 (int4's zero is 8, int8's 0); uint4_min: mins fp16
//            [N, K/G] in their place (QuantWeight::zeros), w = code * scale + min
//   4-bit: per block of 32 k, byte j holds k = j (low nibble) and k = 16 + j (high nibble).
//
// Math (weight-only, "A16W8 / A16W4"): each row of x is rounded to 16-bit fixed point, q = round(x * 32767 /
// absmax), d = absmax / 32767 (an element's rounding error is at most 1/65534 of the row's largest magnitude:
// for every element above 1/128 of it, less than bf16's own rounding of that element, 1/512). The weight codes
// minus their zero point are widened to int16 and met with q in exact integer multiply-adds (vpmaddwd), summed
// in int32 over each group, then in fp32:   y = d * sum_g s_g * sum_{k in g} (c_k - z_g) q_k
// uint4_min's fp16 min m_g is no integer, so its codes meet q as they are and the min joins in fp32:
//                                           y = d * sum_g (s_g * sum_{k in g} c_k q_k + m_g * sum_{k in g} q_k)
// (the sums of q over each group are the ones the zero points are taken off with; every kernel already has them)
// ops.linear_reference rounds x the same way, then dequantizes and multiplies; the kernel equals it up to fp32
// rounding. One rounding into the activation dtype at the end, bias included. compute_method activate_quant
// ("A8W8", QuantWeight::act_bits = 8) rounds x to int8 instead, q = round(x * 127 / absmax); nothing else changes.
//
// Why not fp32 FMAs on codes widened to fp32: in such a kernel the widening instructions, not the memory, are the
// limit; the int16 path needs about half the instructions per weight and no fp32 work inside a group.
// (Rounding x to int8 instead, llama.cpp's q8_0 . q8_0, needs a few instructions less but adds a 1/254
// activation error.)
//
// Software prefetch: the AVX2 kernels prefetch 2 KiB ahead (simd.h), because the AVX2 VM's hardware prefetchers
// fall behind a thread's stream; the AVX-512 kernel takes none, because on Zen 4 a prefetch in the row slowed it.
// The 16-bit row_avx2 kernel prefetches 8-bit codes only: with 4-bit codes it is bound by its instructions, and
// there the prefetch slowed it (groups of 128 take NIBBLES16 / 8, faster on them). The measurements behind these
// choices: docs/performance.md, "Choices in the code".
//
// ISA (chosen by compute/ops.py): 3 AVX-512 VNNI (gemv_quant_avx512.cpp: vpdpwssd, x laid out to match the
// codes; with activate_quant's int8 x: vpdpbusd, NIBBLES8W), 1 and 2 AVX2+FMA+F16C
// (gemv_quant_avx2.cpp; 2 = AVX-512 without VNNI: its dequantization is AVX-512),
// 0 portable C++; the same rounding of x everywhere, so every level equals ops.linear_reference up to fp32
// summation order. The weight streams row by row; each thread owns a contiguous block of rows, up to 4 rows of x
// share each block of codes (the AVX-512 kernel takes a call of up to 5 rows in one pass: MR_ONE_PASS). At
// batch 1, 4-bit codes in groups of 32, 64 or 128 take the AVX2 NIBBLES16 kernel (codes
// read as words, nibbles isolated in place, x reordered to match); with activate_quant's int8 x, NIBBLES8 (the
// nibbles as bytes, vpmaddubsw: about half the 256-bit multiplies per code, which bound the 16-bit kernel because
// the AVX2 VM issues them at one per 2 cycles);
// 8-bit codes with int8 x take BYTES8 (vpmaddubsw on the codes' magnitudes and x signed like the codes).
// This file: the portable kernel, the dequantization and the entry points; rounding x is activation_rounding.cpp;
// what the files share is in gemv_quant.h.
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemv_quant.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {
// AVX-512 bf16 (vdpbf16ps; AMX machines have it too) at the ISA level the caller runs (ops.isa_level, which
// ALLSPARK_CPU_ISA may cap below the CPU's): whether oneDNN's bf16 GEMM is fast here (ops.gemm_dtype), and whether
// the dequantization may round with vcvtne2ps2bf16
bool bf16_dot_products(int64_t isa) {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return isa >= 4 && has;
}

using namespace qgemv;

// ---- portable ---------------------------------------------------------------------------------
template <int F>
void rows_scalar(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* q = a.q.data() + m * a.padded;
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int z = zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g);
        float acc = 0.f, qsum = 0.f;
        for (int64_t k0 = g * w.group; k0 < (g + 1) * w.group; k0 += FLUSH) {   // int32 never overflows
          int32_t dot = 0, sq = 0;
          for (int64_t k = k0; k < std::min(k0 + FLUSH, (g + 1) * w.group); ++k) {
            dot += (code_at<F>(wr, k) - z) * q[k];
            if constexpr (HAS_MIN<F>) sq += q[k];
          }
          acc += static_cast<float>(dot);
          qsum += static_cast<float>(sq);
        }
        total += half_to_float(w.scales[n * w.groups + g]) * acc;
        if constexpr (HAS_MIN<F>) total += min_of<F>(w.mins + n * w.groups, g) * qsum;
      }
      y[m * N + n] = a.d[m] * total;
    }
  }
}

// rows [n0, n1) of y = x . W^T by the kernel of `layout`; true where the kernel rounded them into the output itself
// (through `finish`, FinishBlock), y left untouched
template <int F>
bool rows(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N,
          int64_t isa, Layout layout, const FinishBlock* finish) {
  if (layout == NIBBLES8 && w.group == BLOCK && M >= AVX2_LANES_MIN_ROWS) {
    rows_lanes_avx2<F>(a, M, w, K, n0, n1, y, N, finish);
    return finish != nullptr;
  } else if (layout == NIBBLES16 || layout == NIBBLES8) rows_nibbles_avx2<F>(a, M, w, n0, n1, y, N, layout);
  else if (layout == BYTES8 && F == INT8 && M >= bytes8_blocked_min_rows(w))
    return rows_bytes8_blocked_avx2<F>(a, M, w, n0, n1, y, N, finish);
  else if (layout == BYTES8) rows_bytes8_avx2<F>(a, M, w, n0, n1, y, N);
  else if (layout != NATURAL) return rows_avx512<F>(a, M, w, K, n0, n1, y, N, layout, finish);
  else if (isa >= 1) rows_avx2<F>(a, M, w, n0, n1, y, N);
  else rows_scalar<F>(a, M, w, n0, n1, y, N);
  return false;
}

// fp32 vectors of codes, for the dequantization below
template <int F>
__attribute__((target("avx2,fma,f16c")))
inline void codes32(const uint8_t* row, int64_t k, __m256 v[4]) {
  __m256i lo, hi;
  codes16<F>(row, k, _mm256_setzero_si256(), &lo, &hi);
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo)));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi)));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1)));
}

// ---- dequantization (prefill) -------------------------------------------------------------------
// one weight: (code - z) * s, or (UINT4_MIN) code * s + m with the product rounded first, as the reference
template <int F>
inline float dequant_value(int code, float z, float s, float m) {
  float p = (static_cast<float>(code) - z) * s;   // UINT4_MIN: z = 0
  if constexpr (HAS_MIN<F>) no_contract(p), p += m;
  return p;
}

// a group's zero point and min as floats (the zero of UINT4_MIN is 0, the min of the other formats 0)
template <int F>
inline void group_offset(const QuantView& w, int64_t n, int64_t g, float* z, float* m) {
  *z = static_cast<float>(zero_of<F>(w.zeros ? w.zeros + n * w.groups : nullptr, g));
  *m = min_of<F>(w.mins ? w.mins + n * w.groups : nullptr, g);
}
template <int F, typename T>
__attribute__((target("avx2,fma,f16c")))
void dequantize_rows_avx2(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out) {
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = _cvtsh_ss(w.scales[n * w.groups + g].x);
      float z, m;
      group_offset<F>(w, n, g, &z, &m);
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z), mv = _mm256_set1_ps(m);
      int64_t k = g * G;
      for (; k < g * G + G32; k += BLOCK) {
        __m256 v[4];
        codes32<F>(wr, k, v);
        for (int i = 0; i < 4; ++i) {
          if constexpr (HAS_MIN<F>) {
            __m256 p = _mm256_mul_ps(v[i], sv);
            no_contract(p);
            simd::store8(out + n * K + k + 8 * i, _mm256_add_ps(p, mv));
          } else {
            simd::store8(out + n * K + k + 8 * i, _mm256_mul_ps(_mm256_sub_ps(v[i], zv), sv));
          }
        }
      }
      for (; k < (g + 1) * G; ++k) out[n * K + k] = static_cast<T>(dequant_value<F>(code_at<F>(wr, k), z, s, m));
    }
  }
}

// the same per block on AVX-512 (any AVX-512 level): 16 codes widened straight to int32 lanes. NE (bf16 output, run
// only where the CPU has AVX-512 bf16; the other instantiation executes no bf16 instruction): two vectors rounded by
// one vcvtne2ps2bf16 instead of ~8 integer ops per 16 values. Both round to nearest even: the same bits for every
// finite product that is not denormal. It matters where the bf16 GEMM after the dequantization is fast (AMX).
template <int F, typename T, bool NE = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
void dequantize_rows_avx512(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out) {
  const int64_t G = w.group, G32 = G & ~(BLOCK - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = _cvtsh_ss(w.scales[n * w.groups + g].x);
      float z, m;
      group_offset<F>(w, n, g, &z, &m);
      const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z), mv = _mm512_set1_ps(m);
      int64_t k = g * G;
      for (; k < g * G + G32; k += BLOCK) {
        __m512i v0, v1;
        if constexpr (FOUR_BIT<F>) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2)), nib = _mm_set1_epi8(0x0F);
          v0 = _mm512_cvtepu8_epi32(_mm_and_si128(b, nib));
          v1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
        } else {
          const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
          const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
          if constexpr (F == INT8) v0 = _mm512_cvtepi8_epi32(b0), v1 = _mm512_cvtepi8_epi32(b1);
          else v0 = _mm512_cvtepu8_epi32(b0), v1 = _mm512_cvtepu8_epi32(b1);
        }
        __m512 lo, hi;
        if constexpr (HAS_MIN<F>) {
          lo = _mm512_mul_ps(_mm512_cvtepi32_ps(v0), sv), hi = _mm512_mul_ps(_mm512_cvtepi32_ps(v1), sv);
          no_contract(lo), no_contract(hi);
          lo = _mm512_add_ps(lo, mv), hi = _mm512_add_ps(hi, mv);
        } else {
          lo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v0), zv), sv);
          hi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v1), zv), sv);
        }
        if constexpr (NE) {
          _mm512_storeu_si512(out + n * K + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        } else {
          simd::store16(out + n * K + k, lo);
          simd::store16(out + n * K + k + 16, hi);
        }
      }
      for (; k < (g + 1) * G; ++k) out[n * K + k] = static_cast<T>(dequant_value<F>(code_at<F>(wr, k), z, s, m));
    }
  }
}

template <int F, typename T>
void dequantize_rows(const QuantView& w, int64_t K, int64_t n0, int64_t n1, T* out, int64_t isa) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (bf16_dot_products(isa)) return dequantize_rows_avx512<F, T, true>(w, K, n0, n1, out);
  }
  if (isa >= 2) return dequantize_rows_avx512<F, T>(w, K, n0, n1, out);
  if (isa >= 1) return dequantize_rows_avx2<F, T>(w, K, n0, n1, out);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w.codes + n * w.row_bytes;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / w.group;
      float z, m;
      group_offset<F>(w, n, g, &z, &m);
      const float s = half_to_float(w.scales[n * w.groups + g]);
      out[n * K + k] = static_cast<T>(dequant_value<F>(code_at<F>(wr, k), z, s, m));
    }
  }
}

#define DISPATCH_FORMAT(fmt, ...)                        \
  switch (fmt) {                                         \
    case INT8: { constexpr int F = INT8; __VA_ARGS__; break; }   \
    case UINT8: { constexpr int F = UINT8; __VA_ARGS__; break; } \
    case INT4: { constexpr int F = INT4; __VA_ARGS__; break; }   \
    case UINT4: { constexpr int F = UINT4; __VA_ARGS__; break; } \
    default: { constexpr int F = UINT4_MIN; __VA_ARGS__; break; }    \
  }

// out[m, c] = y[m * ldy + c] + bias[c], rounded once into O, for m < rows, c < cols (the scalar form, and the AVX2
// one's last columns)
template <typename O>
inline void finish_block(const float* y, int64_t ldy, const O* bias, O* out, int64_t ldo, int64_t rows, int64_t cols,
                         int64_t c0 = 0) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = c0; c < cols; ++c)
      out[m * ldo + c] = static_cast<O>(y[m * ldy + c] + (bias ? static_cast<float>(bias[c]) : 0.f));
}

// the same 8 at a time (a decode step of 32 rows converts ~8 M of them)
template <typename O>
__attribute__((target("avx2,fma"))) void finish_block_avx2(const float* y, int64_t ldy, const O* bias, O* out,
                                                           int64_t ldo, int64_t rows, int64_t cols) {
  const int64_t c8 = cols / 8 * 8;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < c8; c += 8) {
      __m256 v = _mm256_loadu_ps(y + m * ldy + c);
      if (bias) v = _mm256_add_ps(v, simd::load8(bias + c));
      simd::store8(out + m * ldo + c, v);
    }
  finish_block(y, ldy, bias, out, ldo, rows, cols, c8);
}

template <typename O>
void finish_block_of(const float* y, int64_t ldy, const O* bias, O* out, int64_t ldo, int64_t rows, int64_t cols,
                     int64_t isa) {
  if (isa >= 1) finish_block_avx2(y, ldy, bias, out, ldo, rows, cols);
  else finish_block(y, ldy, bias, out, ldo, rows, cols);
}

template <typename O>
void run_linear(const float* x, int64_t M, int64_t K, const QuantView& w, const O* bias, O* out, int64_t isa) {
  const int64_t N = w.rows;
  const bool x8 = w.act_max == 127.f;   // activate_quant: x fits int8
  // the AVX-512 kernel's x: 8-bit codes in groups smaller than a chunk take the NIBBLES order too (gemv_quant.h)
  const bool per_chunk = w.groups == 1 || w.group % CHUNK == 0;
  const Layout wide = x8 ? NIBBLES8W : w.format >= INT4 || !per_chunk ? NIBBLES : PAIRS;
  // AVX2: the batch-1 kernels for every row count where the weight suits them, each row of x met as it is alone (a
  // tile of weight rows at a time from 2 rows on): faster than the many-row kernel at every count it takes, and a
  // row's result never depends on its batch (benchmarks/gemv_quant_micro.py)
  const Layout layout = isa >= 3 && avx512_fits(w) ? wide
                        : isa >= 1 && nibbles16_fits(w, K) ? (x8 ? NIBBLES8 : NIBBLES16)
                        : isa >= 1 && x8 && bytes8_fits(w, K) ? BYTES8
                                                                      : NATURAL;
  const Act16 a = round_activations(x, M, K, isa, w.act_max, layout, w.group);
  // bf16 out: the fp32 sums in a buffer kept by the calling thread (a fresh one would be zero filled, or page
  // faulted in, on every call: ~8 M values per 32-row decode step); the kernel writes every element it reads
  thread_local std::vector<float> scratch;
  if (!std::is_same_v<O, float> && static_cast<int64_t>(scratch.size()) < M * N) scratch.resize(M * N);
  float* y = std::is_same_v<O, float> ? reinterpret_cast<float*>(out) : scratch.data();
  const bool direct = std::is_same_v<O, float> && !bias;   // y is the output
  // a kernel keeping its sums in a tile rounds them a block at a time, while they are in cache
  const FinishBlock finish = [&](const float* tile, int64_t ld, int64_t m0, int64_t m1, int64_t c0, int64_t c1) {
    finish_block_of(tile, ld, bias ? bias + c0 : nullptr, out + m0 * N + c0, N, m1 - m0, c1 - c0, isa);
  };
  const int64_t grain = allspark::weight_rows_grain(w.row_bytes);
  allspark::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    bool finished = false;
    DISPATCH_FORMAT(w.format, finished = rows<F>(a, M, w, K, n0, n1, y, N, isa, layout, direct ? nullptr : &finish));
    if (direct || finished) return;
    finish_block_of(y + n0, N, bias ? bias + n0 : nullptr, out + n0, N, M, n1 - n0, isa);
  });
}

}  // namespace

QuantView QuantWeight::view() const {
  QuantView v;
  v.codes = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  v.scales = scales.data_ptr<at::Half>();
  v.zeros = zeros && format != UINT4_MIN ? zeros->data_ptr<uint8_t>() : nullptr;
  v.mins = zeros && format == UINT4_MIN ? zeros->data_ptr<at::Half>() : nullptr;
  v.format = format;
  v.rows = qweight.size(0);
  v.row_bytes = qweight.size(1);
  v.groups = scales.size(1);
  v.group = in_features / v.groups;
  v.act_max = act_bits == 8 ? 127.f : ACT_MAX;
  return v;
}

bool QuantWeight::native_at_any_rows(int64_t isa) const {
  if (isa < 1 || act_bits != 8 || format == UINT8 || scales.size(1) == 1) return false;
  const int64_t group = in_features / scales.size(1);
  // AVX2: the lanes kernel's weights, the NIBBLES8 kernel's in groups of 32 (gemv_quant_avx2_lanes.cpp), and
  // grouped INT8 codes (gemv_quant_avx2_bytes8.cpp)
  if (isa < 3)
    return (group == BLOCK && nibbles16_fits(view(), in_features)) ||
           (format == INT8 && bytes8_fits(view(), in_features));
  // the lanes kernel's groups (gemv_quant_avx512.cpp: rows_avx512_of); its x is padded to whole chunks of 512 k,
  // and where that pads K by more than a quarter (SmolLM2's 576: 1024) the dequantized GEMM is faster again
  const int64_t padded = (in_features + CHUNK - 1) / CHUNK * CHUNK;
  return group % CHUNK != 0 && group <= 256 && 4 * padded <= 5 * in_features;
}

void QuantWeight::check() const {
  TORCH_CHECK(format >= INT8 && format <= UINT4_MIN, "QuantWeight: unknown format ", format);
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "QuantWeight: act_bits must be 8 or 16, got ", act_bits);
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
  const bool has_zeros = format == UINT8 || format == UINT4 || format == UINT4_MIN;
  TORCH_CHECK(has_zeros == zeros.has_value(),
              "QuantWeight: zeros are given exactly for uint8/uint4 (zero points) and uint4_min (mins)");
  if (zeros && format == UINT4_MIN) {
    TORCH_CHECK(zeros->scalar_type() == at::kHalf && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "QuantWeight: uint4_min's zeros (its mins) must be fp16 shaped like scales");
  } else if (zeros) {
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "QuantWeight: zeros must be uint8 shaped like scales");
  }
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
  const auto xc = x.contiguous();
  if (x.scalar_type() == at::kFloat) {
    run_linear<float>(xc.data_ptr<float>(), M, K, v, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                      isa);
  } else {
    // x in fp32 once, shared by every weight row: widened here, not by an ATen op, whose code is cold after the
    // weight stream on every GEMV of a decode step
    thread_local std::vector<float> widened;
    widened.resize(M * K);
    widen_bf16(xc.data_ptr<at::BFloat16>(), M * K, widened.data(), isa);
    run_linear<at::BFloat16>(widened.data(), M, K, v, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                             y.data_ptr<at::BFloat16>(), isa);
  }
  return y;
}

torch::Tensor dequantize_weight(const QuantWeight& w, at::ScalarType dtype, int64_t isa) {
  w.check();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_weight: fp32 or bf16 output");
  const QuantView v = w.view();
  const int64_t K = w.in_features;
  auto out = torch::empty({v.rows, K}, torch::TensorOptions().dtype(dtype));
  const int64_t grain = allspark::weight_rows_grain(v.row_bytes);
  allspark::parallel_for(0, v.rows, grain, [&](int64_t n0, int64_t n1) {
    if (dtype == at::kFloat) {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, float>(v, K, n0, n1, out.data_ptr<float>(), isa));
    } else {
      DISPATCH_FORMAT(v.format, dequantize_rows<F, at::BFloat16>(v, K, n0, n1, out.data_ptr<at::BFloat16>(), isa));
    }
  });
  return out;
}

torch::Tensor linear_widened(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b,
                             int64_t isa) {
  const auto* q = std::get_if<QuantWeight>(&w);
  if (q) q->check();
  const torch::Tensor dense = q ? torch::Tensor() : std::get<torch::Tensor>(w);
  const int64_t K = q ? q->in_features : dense.size(1), N = q ? q->qweight.size(0) : dense.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear_widened: x ", x.sizes(), " for a weight of K = ", K);
  const auto xf = x.to(torch::kFloat).contiguous();
  auto yt = torch::empty({N, x.size(0)}, xf.options());   // y^T: each tile fills a contiguous block of rows
  const int64_t tile = std::max<int64_t>(16, WIDEN_TILE_BYTES / (4 * std::max<int64_t>(K, 1)));
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nt = std::min(tile, N - n0);
    torch::Tensor wt;
    if (q) {
      const QuantWeight rows{q->qweight.narrow(0, n0, nt), q->scales.narrow(0, n0, nt),
                             q->zeros ? std::optional<torch::Tensor>(q->zeros->narrow(0, n0, nt)) : std::nullopt,
                             q->format, q->in_features, q->act_bits};
      wt = dequantize_weight(rows, at::kFloat, isa);
    } else {
      wt = dense.narrow(0, n0, nt).to(torch::kFloat);
    }
    auto out = yt.narrow(0, n0, nt);
    at::mm_out(out, wt, xf.t());
  }
  auto y = yt.t();
  if (b) y = y + b->to(torch::kFloat);
  return y.to(x.scalar_type()).contiguous();
}

torch::Tensor project(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b, int64_t isa,
                      int64_t native_rows) {
  if (const auto* q = std::get_if<QuantWeight>(&w)) {
    if (native_rows == ALL_ROWS_NATIVE || x.size(0) <= quant_native_rows(isa, *q)) return linear_quant(x, *q, b, isa);
    // ATen's GEMM on the dequantized weight, as ops.linear_dequantized: bf16 where the CPU has bf16 dot products,
    // else fp32 (without them oneDNN's bf16 GEMM is far slower; ops.gemm_dtype says how much), the weight then
    // dequantized a tile at a time; activate_quant: x rounded as the GEMV would meet it
    const bool bf16 = x.scalar_type() == at::kBFloat16 && bf16_dot_products(isa);
    const auto gemm_dtype = bf16 ? at::kBFloat16 : at::kFloat;
    const auto xg = q->act_bits == 8 ? round_rows(x, 127.0, gemm_dtype, isa) : x.to(gemm_dtype);
    if (bf16) return at::linear(xg, dequantize_weight(*q, at::kBFloat16, isa), b);
    return linear_widened(xg, w, b, isa).to(x.scalar_type());
  }
  const auto& dense = std::get<torch::Tensor>(w);
  if (x.size(0) <= native_rows) return linear_small_m(x, dense, b, isa);
  if (x.scalar_type() == at::kBFloat16 && dense.scalar_type() == at::kBFloat16 && !bf16_dot_products(isa))
    return linear_widened(x, w, b, isa);   // as ops.gemm_dtype decides for Python
  return at::linear(x, dense, b);
}
