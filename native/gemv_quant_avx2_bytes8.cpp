// The AVX2 quantized GEMV for several rows of int8 x (activate_quant, BYTES8) against signed 8-bit codes (INT8:
// GGUF's Q8_0, InstantQuant's int8) in groups of a multiple of 32 or per channel. Called by gemv_quant.cpp from
// bytes8_blocked_min_rows rows, prompt rows of grouped codes included (QuantWeight::native_at_any_rows).
//
// The batch-1 kernels (gemv_quant_avx2_m1.cpp) meet each (weight row, row of x) pair alone: per 32 codes a load of
// the codes and of x, the codes' magnitudes, x signed like them, vpmaddubsw, vpmaddwd, and the group's sums. Row by
// row over a tile of weight rows that is ~8 instructions for 32 multiply-adds. Here R_ROWS weight rows and MB rows
// of x share each step: a vector of codes is loaded and made into magnitudes once for the MB rows, a vector of x once
// for the R weight rows, so each pair costs the sign, the two multiplies and an add. Every pair runs its batch-1
// kernel's arithmetic on the same values in the same order, so a row's result is the same bits as alone: it does not
// depend on how many rows share the call.
// - Groups of 32 (Q8_0; row_bytes8_g32_m1_avx2): a unit of eight groups is brought into lanes, a tile of weight rows
//   at a time and each row of x once, as the 4-bit lanes kernel does (gemv_quant_avx2_lanes.cpp: lane j holds 4
//   values of group (0, 2, 4, 6, 1, 3, 5, 7)[j] in each of 8 vectors), so the 8 vectors' products leave every group's
//   exact sum in its lane and one FMA scales the eight; the groups after the runs of eight one at a time.
// - Larger groups and per channel (row_bytes8_m1_avx2): the codes read in place, each group's 8 int32 lanes summed
//   block by block, converted and scaled into 8 fp32 lanes, over tiles of weight rows as the other many-row
//   kernels (gemv_quant.h: tiled_rows, the next tile prefetched meanwhile).
// Either way a tile of weight rows (TILE_BYTES) stays in L2 while every row of x meets it.
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

// weight rows and rows of x per step: R x MB int32 sums in registers beside R codes' magnitudes and signs and one
// vector of x (16 ymm registers; larger groups' fp32 totals, touched once a group, may live in memory)
constexpr int R_ROWS = 2;
constexpr int MB_MAX = 3;

// R weight rows (from n) against MB rows of x (from m) of one tile, groups of several blocks or per channel
template <int MB>
AVX2_ISA void pass(const Act16& a, const QuantView& w, int64_t n, int64_t rows, int64_t m, float* y, int64_t N) {
  constexpr int R = R_ROWS;
  const int64_t blocks = w.group / BLOCK;
  const uint8_t* wr[R];
  const at::Half* sr[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = n + std::min<int64_t>(r, rows - 1);   // a last odd row computed twice, stored once
    wr[r] = w.codes + row * w.row_bytes, sr[r] = w.scales + row * w.groups;
  }
  const int8_t* xr[MB];
  for (int j = 0; j < MB; ++j) xr[j] = a.q8.data() + (m + j) * a.padded;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R * MB];
#pragma GCC unroll 8
  for (int i = 0; i < R * MB; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 s[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = _mm256_set1_ps(_cvtsh_ss(sr[r][g].x));
    __m256i acc[R * MB];
#pragma GCC unroll 8
    for (int i = 0; i < R * MB; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k = (g * blocks + b) * BLOCK;
      __m256i mag[R], sgn[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        sgn[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + k));
        mag[r] = _mm256_abs_epi8(sgn[r]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < MB; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[j] + k));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r * MB + j] = _mm256_add_epi32(
              acc[r * MB + j], _mm256_madd_epi16(_mm256_maddubs_epi16(mag[r], _mm256_sign_epi8(x, sgn[r])), ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < MB; ++j)
        total[r * MB + j] = _mm256_fmadd_ps(s[r], _mm256_cvtepi32_ps(acc[r * MB + j]), total[r * MB + j]);
  }
  for (int r = 0; r < std::min<int64_t>(R, rows); ++r)
    for (int j = 0; j < MB; ++j) y[(m + j) * N + n + r] = a.d[m + j] * simd::hsum8(total[r * MB + j]);
}

// 2 weight rows x 3 rows of x a step over tiles of weight rows (gemv_quant.h: tiled_rows)
void rows_tiled(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  tiled_rows<MB_MAX, R_ROWS>(w, M, n0, n1, [&](int64_t m, int64_t mb, int64_t n, int64_t rows) {
    static_assert(MB_MAX == 3, "one case per pass size");
    switch (mb) {
      case 1: pass<1>(a, w, n, rows, m, y, N); break;
      case 2: pass<2>(a, w, n, rows, m, y, N); break;
      default: pass<3>(a, w, n, rows, m, y, N); break;
    }
  });
}

// ---- groups of 32: units of eight groups in lanes ----------------------------------------------------------------
constexpr int64_t UNIT_BYTES = 8 * BLOCK;                   // a unit's codes (or x) in lanes: 8 vectors
constexpr int64_t W_UNIT_BYTES = UNIT_BYTES + 32;           // ... then its eight scales in fp32, lane order

// 8 groups' 32-byte runs from `src` (count of them there, the rest zero) into the lanes layout at out: group 2c + b's
// first 16 values in half b of run lo[c], its last 16 in half b of hi[c] (store_lanes' input)
AVX2_ISA void unit_to_lanes(const uint8_t* src, int64_t count, uint8_t* out) {
  __m256i lo[4], hi[4];
  for (int c = 0; c < 4; ++c) {
    const __m256i a = 2 * c < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * c))
                                    : _mm256_setzero_si256();
    const __m256i b = 2 * c + 1 < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * c + 32))
                                        : _mm256_setzero_si256();
    lo[c] = _mm256_permute2x128_si256(a, b, 0x20), hi[c] = _mm256_permute2x128_si256(a, b, 0x31);
  }
  store_lanes(lo, hi, out);
}

// weight row n's unit u into the scratch: its codes in lanes, then the eight groups' scales in lane order
AVX2_ISA void weight_unit(const QuantView& w, int64_t n, int64_t u, uint8_t* out) {
  const int64_t g0 = 8 * u, count = std::min<int64_t>(8, w.groups - g0);
  unit_to_lanes(w.codes + n * w.row_bytes + g0 * BLOCK, count, out);
  float* scale_out = reinterpret_cast<float*>(out + UNIT_BYTES);
  for (int j = 0; j < 8; ++j)
    scale_out[j] = GROUP_OF_LANE[j] < count ? _cvtsh_ss(w.scales[n * w.groups + g0 + GROUP_OF_LANE[j]].x) : 0.f;
}

// a unit's eight exact group sums for R weight rows (wc) and MB rows of x (xc), lane j: group GROUP_OF_LANE[j]
template <int R, int MB>
AVX2_ISA inline void unit_sums(const uint8_t* const* wc, const uint8_t* const* xc, __m256i* S) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int i = 0; i < R * MB; ++i) S[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    __m256i sgn[R], mag[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      sgn[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[r] + 32 * q));
      mag[r] = _mm256_abs_epi8(sgn[r]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + 32 * q));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        S[r * MB + m] = _mm256_add_epi32(
            S[r * MB + m], _mm256_madd_epi16(_mm256_maddubs_epi16(mag[r], _mm256_sign_epi8(x, sgn[r])), ones));
    }
  }
}

// rows [0, rows) of a tile against the pass's MB rows of x (lanes_rows' LanesPass), R_ROWS weight rows at a time, as
// row_bytes8_g32_m1_avx2 computes each pair. Out of line, as the 4-bit kernel's dot_pass (it says why)
template <int MB>
AVX2_ISA __attribute__((noinline)) void lanes_pass(const Act16& a, const QuantView& w, const LanesPass<MB_MAX>& p) {
  constexpr int R = R_ROWS;
  lanes_pass_steps<R, MB>(
      p, a.d.data(), W_UNIT_BYTES, UNIT_BYTES,
      [](const uint8_t* const* wu, const uint8_t* const* xc, __m256i* S) AVX2_ISA { unit_sums<R, MB>(wu, xc, S); },
      [](const __m256i* S, const uint8_t* const* wu, const uint8_t* const*, __m256* total) AVX2_ISA {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256 scales = _mm256_loadu_ps(reinterpret_cast<const float*>(wu[r] + UNIT_BYTES));
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m)
            total[r * MB + m] = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(S[r * MB + m]), total[r * MB + m]);
        }
      },
      [&](int64_t n, int, const int32_t* lanes) AVX2_ISA {
        const at::Half* sr = w.scales + n * w.groups;
        float rest = 0.f;
        for (int64_t h = 0; h < p.tail; ++h)   // group 8 full + h sits in lane h / 2 (even h) or 4 + h / 2 (odd)
          rest = add_left_over_group<INT8>(rest, lanes[(h % 2) * 4 + h / 2], 0, sr, nullptr, nullptr, 8 * p.full + h);
        return rest;
      });
}

AVX2_ISA void rows_lanes(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y,
                         int64_t N, const FinishBlock* finish) {
  static_assert(MB_MAX == 3, "one case per pass size");
  lanes_rows<R_ROWS, MB_MAX>(
      M, w.groups, n0, n1, W_UNIT_BYTES, UNIT_BYTES, y, N, finish,
      [&](int64_t m, int64_t u, uint8_t* out) AVX2_ISA {
        unit_to_lanes(reinterpret_cast<const uint8_t*>(a.q8.data() + m * a.padded + 8 * u * BLOCK),
                      std::min<int64_t>(8, w.groups - 8 * u), out);
      },
      [&](int64_t n, int64_t u, uint8_t* out) AVX2_ISA { weight_unit(w, n, u, out); },
      [&](int64_t mb, const LanesPass<MB_MAX>& p) AVX2_ISA {
        switch (mb) {
          case 1: lanes_pass<1>(a, w, p); break;
          case 2: lanes_pass<2>(a, w, p); break;
          default: lanes_pass<3>(a, w, p); break;
        }
      });
}

}  // namespace

template <int F>
bool rows_bytes8_blocked_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y,
                              int64_t N, const FinishBlock* finish) {
  if constexpr (F == INT8) {
    if (w.group == BLOCK) {
      rows_lanes(a, M, w, n0, n1, y, N, finish);
      return finish != nullptr;
    }
    rows_tiled(a, M, w, n0, n1, y, N);
  }
  return false;
}

#define ROWS_BYTES8_BLOCKED(F)                                                                              \
  template bool rows_bytes8_blocked_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, \
                                            int64_t, const FinishBlock*);
ROWS_BYTES8_BLOCKED(INT8)
ROWS_BYTES8_BLOCKED(UINT8)
ROWS_BYTES8_BLOCKED(INT4)
ROWS_BYTES8_BLOCKED(UINT4)
ROWS_BYTES8_BLOCKED(UINT4_MIN)

}  // namespace qgemv
