// The AVX2 quantized GEMV for several rows of int8 x (activate_quant, NIBBLES8) against 4-bit codes in groups of 32:
// codes in lanes of groups. Called by gemv_quant.cpp from AVX2_LANES_MIN_ROWS rows, prompt rows included
// (QuantWeight::native_at_any_rows).
//
// The batch-1 kernel (gemv_quant_avx2_m1.cpp, row_nibbles_m1_avx2) splits every 32 bytes of codes into nibbles and
// reduces eight groups' int16 pair sums with a tree of horizontal adds, once per (weight row, row of x): with many rows
// of x those instructions, not its vpmaddubsw, set the pace. Here a unit of eight groups (256 k) of a weight row is
// brought, once for all rows of x, into 8 vectors of bytes whose dword lane j holds 4 codes of group
// (0, 2, 4, 6, 1, 3, 5, 7)[j] (vector q < 4: the low nibbles of the group's bytes 4q .. 4q + 3, 4 + q: their high
// nibbles), and each row of x the same way: one vpmaddubsw per vector pair, the eight added in int16 (a pair's sum is
// at most 2 * 15 * 128, eight of them 30720) and one vpmaddwd by ones leave each group's exact int32 sum in its lane,
// in the batch-1 kernel's lane order. From those exact sums on, every (weight row, row of x) runs the batch-1 kernel's
// epilogue: add_eight_groups' operations on the same values (add_unit; its scales, zero points and mins converted and
// put in lane order once per weight row instead of once per pair), then the left-over groups one at a time
// (add_left_over_group), then hsum8, so a row's result is the same bits as alone: it does not depend on how many
// rows share the call.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemv_quant.h"
#include "gemv_quant_avx2.h"
#include "gemv_quant_avx2_lanes.h"
#include "simd.h"

namespace qgemv {
namespace {

#define AVX2_ISA __attribute__((target("avx2,fma,f16c")))

constexpr int64_t UNIT = 8 * BLOCK;    // k per unit: eight groups of 32, a group per int32 lane
constexpr int64_t LANES_BYTES = 256;   // a unit of codes or of x in lanes: 8 vectors of 32 bytes
// a weight row's unit in the scratch: its codes in lanes, then the eight groups' scales (fp32), zero points (int32)
// and mins (fp32) in the same lane order, as add_eight_groups<F, true> converts them
constexpr int64_t W_SCALE_AT = LANES_BYTES, W_ZERO_AT = LANES_BYTES + 32, W_MIN_AT = LANES_BYTES + 64;
constexpr int64_t W_UNIT_BYTES = LANES_BYTES + 96;
// a row of x's unit: x in lanes, then its eight group sums (int32, lane order: Act16::block_sum_lanes) and those sums
// as fp32 (UINT4_MIN's min terms)
constexpr int64_t X_SUM_AT = LANES_BYTES, X_SUMF_AT = LANES_BYTES + 32;
constexpr int64_t X_UNIT_BYTES = LANES_BYTES + 64;
// weight rows and rows of x per step of a pass: R x MB int16 sums and as many fp32 totals in registers, beside R
// vectors of codes and one of x (16 ymm registers)
constexpr int R_ROWS = 2;
constexpr int MB_MAX = 3;

// weight row n's unit u (its groups 8u .. 8u + 7, those past the row's end zero) into the scratch at out: the codes
// of group 2c + b are bytes 16b .. 16b + 15 of the unit's run c of 32 bytes, low nibbles first (gemv_quant.h:
// code_at)
template <int F>
AVX2_ISA void weight_unit(const QuantView& w, int64_t n, int64_t u, uint8_t* out) {
  const int64_t g0 = 8 * u, count = std::min<int64_t>(8, w.groups - g0);
  const uint8_t* codes = w.codes + n * w.row_bytes + g0 * BLOCK / 2;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i lo[4], hi[4];
  for (int c = 0; c < 4; ++c) {
    const __m256i v = 2 * c < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c))
                                    : _mm256_setzero_si256();
    lo[c] = _mm256_and_si256(v, nib), hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  }
  store_lanes(lo, hi, out);
  float* scale_out = reinterpret_cast<float*>(out + W_SCALE_AT);
  __m256i* zero_out = reinterpret_cast<__m256i*>(out + W_ZERO_AT);
  float* min_out = reinterpret_cast<float*>(out + W_MIN_AT);
  if (count == 8) {   // add_eight_groups' shuffles to the lane order: fp16 words and zero-point bytes 0, 2, 4, 6, 1, ..
    const int64_t at = n * w.groups + g0;
    _mm256_storeu_ps(scale_out, eight_halves<true>(w.scales + at));
    if constexpr (F == UINT4)
      _mm256_storeu_si256(zero_out, _mm256_cvtepu8_epi32(_mm_shuffle_epi8(
                                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at)),
                                        _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15))));
    if constexpr (HAS_MIN<F>) _mm256_storeu_ps(min_out, eight_halves<true>(w.mins + at));
    return;
  }
  alignas(32) float scale[8] = {}, mn[8] = {};
  alignas(32) int32_t zero[8] = {};
  for (int j = 0; j < 8; ++j) {
    const int64_t g = g0 + GROUP_OF_LANE[j];
    if (g - g0 >= count) continue;
    scale[j] = _cvtsh_ss(w.scales[n * w.groups + g].x);
    if constexpr (F == UINT4) zero[j] = w.zeros[n * w.groups + g];
    if constexpr (HAS_MIN<F>) mn[j] = _cvtsh_ss(w.mins[n * w.groups + g].x);
  }
  _mm256_storeu_ps(scale_out, _mm256_load_ps(scale));
  _mm256_storeu_si256(zero_out, _mm256_load_si256(reinterpret_cast<__m256i*>(zero)));
  _mm256_storeu_ps(min_out, _mm256_load_ps(mn));
}

// row m of x's unit u (NIBBLES8: per 64 k, the 32 bytes that meet the codes' low nibbles, then the 32 that meet their
// high nibbles) into lanes the same way, with its group sums
AVX2_ISA void x_unit(const Act16& a, int64_t m, int64_t u, int64_t groups, uint8_t* out) {
  const int64_t g0 = 8 * u, count = std::min<int64_t>(8, groups - g0);
  const int8_t* x = a.q8.data() + m * a.padded + g0 * BLOCK;
  __m256i lo[4], hi[4];
  for (int c = 0; c < 4; ++c) {
    const bool in = 2 * c < count;
    lo[c] = in ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * c)) : _mm256_setzero_si256();
    hi[c] = in ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * c + 32)) : _mm256_setzero_si256();
  }
  store_lanes(lo, hi, out);
  alignas(32) int32_t sums[8] = {};
  if (count == 8) {   // a whole unit: Act16's lane-ordered block sums as the batch-1 kernel loads them
    std::copy_n(a.block_sum_lanes.data() + m * (a.padded / BLOCK) + g0, 8, sums);
  } else {
    for (int j = 0; j < 8; ++j)
      if (GROUP_OF_LANE[j] < count) sums[j] = a.block_sum[m * (a.padded / BLOCK) + g0 + GROUP_OF_LANE[j]];
  }
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + X_SUM_AT), v);
  _mm256_storeu_ps(reinterpret_cast<float*>(out + X_SUMF_AT), _mm256_cvtepi32_ps(v));
}

// a unit's eight exact group sums for R weight rows (wc) and MB rows of x (xc), lane j: group GROUP_OF_LANE[j]
template <int R, int MB>
AVX2_ISA inline void unit_sums(const uint8_t* const* wc, const uint8_t* const* xc, __m256i* S) {
  __m256i P[R * MB];
#pragma GCC unroll 8
  for (int i = 0; i < R * MB; ++i) P[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    __m256i codes[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) codes[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[r] + 32 * q));
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + 32 * q));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) P[r * MB + m] = _mm256_add_epi16(P[r * MB + m], _mm256_maddubs_epi16(codes[r], xv));
    }
    // each sum in its register from vector to vector: left free, the compiler reassociates the adds into a tree over
    // all 8 products of each pair and spills them to the stack
#pragma GCC unroll 8
    for (int i = 0; i < R * MB; ++i) asm("" : "+x"(P[i]));
  }
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int i = 0; i < R * MB; ++i) S[i] = _mm256_madd_epi16(P[i], ones);
}

// add_eight_groups<F, true>'s arithmetic on the operands the scratch holds (the same values: fp16 -> fp32 and
// uint8 -> int32 are exact): the zero point off in int32, UINT4_MIN's min term, then the scaled sums
template <int F>
AVX2_ISA inline __m256 add_unit(__m256i sums, const uint8_t* wu, const uint8_t* xu, __m256 total) {
  const __m256i group_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + X_SUM_AT));
  if constexpr (F == INT4) {
    sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(group_q, 3));
  } else if constexpr (F == UINT4) {
    sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu + W_ZERO_AT)), group_q));
  } else if constexpr (HAS_MIN<F>) {
    total = _mm256_fmadd_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(wu + W_MIN_AT)),
                            _mm256_loadu_ps(reinterpret_cast<const float*>(xu + X_SUMF_AT)), total);
  }
  return _mm256_fmadd_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(wu + W_SCALE_AT)), _mm256_cvtepi32_ps(sums),
                         total);
}

using Pass = LanesPass<MB_MAX>;

// rows [0, rows) of a tile against the pass's MB rows of x, R_ROWS weight rows at a time. Not inlined: inlined into
// its driver, GCC 12 spilled its vectors to the stack in the inner loop (111 against 263 G multiply-adds/s
// at 512 rows of the model's shapes, run as AVX2 on a Zen 5 core)
template <int F, int MB>
AVX2_ISA __attribute__((noinline)) void dot_pass(const Act16& a, const QuantView& w, const Pass& p) {
  constexpr int R = R_ROWS;
  const int64_t nb = a.padded / BLOCK;
  lanes_pass_steps<R, MB>(
      p, a.d.data(), W_UNIT_BYTES, X_UNIT_BYTES,
      [](const uint8_t* const* wu, const uint8_t* const* xc, __m256i* S) AVX2_ISA { unit_sums<R, MB>(wu, xc, S); },
      [](const __m256i* S, const uint8_t* const* wu, const uint8_t* const* xc, __m256* total) AVX2_ISA {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) total[r * MB + m] = add_unit<F>(S[r * MB + m], wu[r], xc[m], total[r * MB + m]);
      },
      [&](int64_t n, int m, const int32_t* lanes) AVX2_ISA {
        const at::Half* sr = w.scales + n * w.groups;
        const uint8_t* zr = w.zeros ? w.zeros + n * w.groups : nullptr;
        const at::Half* mr = w.mins ? w.mins + n * w.groups : nullptr;
        float rest = 0.f;
        for (int64_t h = 0; h < p.tail; ++h) {   // group g + h sits in lane h / 2 (even h) or 4 + h / 2 (odd)
          const int64_t g = 8 * p.full + h;
          rest = add_left_over_group<F>(rest, lanes[(h % 2) * 4 + h / 2], a.block_sum[p.xm[m] * nb + g], sr, zr, mr, g);
        }
        return rest;
      });
}

template <int F>
AVX2_ISA void dot_pass_mb(int64_t mb, const Act16& a, const QuantView& w, const Pass& p) {
  static_assert(MB_MAX == 3, "dot_pass_mb: one case per pass size");
  switch (mb) {
    case 1: dot_pass<F, 1>(a, w, p); break;
    case 2: dot_pass<F, 2>(a, w, p); break;
    default: dot_pass<F, 3>(a, w, p); break;
  }
}

template <int F>
AVX2_ISA void rows_lanes_avx2_isa(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y,
                                  int64_t N, const FinishBlock* finish) {
  lanes_rows<R_ROWS, MB_MAX>(
      M, w.groups, n0, n1, W_UNIT_BYTES, X_UNIT_BYTES, y, N, finish,
      [&](int64_t m, int64_t u, uint8_t* out) AVX2_ISA { x_unit(a, m, u, w.groups, out); },
      [&](int64_t n, int64_t u, uint8_t* out) AVX2_ISA { weight_unit<F>(w, n, u, out); },
      [&](int64_t mb, const Pass& p) AVX2_ISA { dot_pass_mb<F>(mb, a, w, p); });
}

}  // namespace

template <int F>
void rows_lanes_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                     int64_t N, const FinishBlock* finish) {
  if constexpr (FOUR_BIT<F>) rows_lanes_avx2_isa<F>(a, M, w, n0, n1, y, N, finish);
}

#define ROWS_LANES_AVX2(F)                                                                                     \
  template void rows_lanes_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, int64_t, float*, \
                                   int64_t, const FinishBlock*);
ROWS_LANES_AVX2(INT8)
ROWS_LANES_AVX2(UINT8)
ROWS_LANES_AVX2(INT4)
ROWS_LANES_AVX2(UINT4)
ROWS_LANES_AVX2(UINT4_MIN)

}  // namespace qgemv
