// The AVX2 quantized GEMV for several rows of int8 x (activate_quant, BYTES8) against signed 8-bit codes (INT8:
// GGUF's Q8_0, InstantQuant's int8) in groups of a multiple of 32 or per channel. Called by gemv_quant.cpp from
// AVX2_BYTES8_MIN_ROWS rows, prompt rows included (QuantWeight::native_at_any_rows).
//
// The batch-1 kernel (gemv_quant_avx2_m1.cpp, row_bytes8_m1_avx2) meets each (weight row, row of x) pair alone: per
// 32 codes a load of the codes and of x, the codes' magnitudes, x signed like them, vpmaddubsw, vpmaddwd and an add,
// and per group a conversion and an FMA. Row by row over a tile of weight rows that is ~8 instructions for 32
// multiply-adds. Here R_ROWS weight rows and MB rows of x share each step: a block of codes is loaded and made into
// magnitudes once for the MB rows, a block of x once for the R weight rows, so each pair costs the sign, the two
// multiplies, the add and its group's conversion and FMA. Every pair runs the batch-1 kernel's arithmetic on the
// same values in the same order (its group's int32 lanes summed block by block, converted, scaled into eight fp32
// lanes group after group, hsum8 at the end), so a row's result is the same bits as alone: it does not depend on
// how many rows share the call. The codes are read in place (no reordering): a tile of weight rows stays in L2
// while every row of x meets it.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemv_quant.h"
#include "simd.h"

namespace qgemv {
namespace {

#define AVX2_ISA __attribute__((target("avx2,fma,f16c")))

// weight rows per tile: their codes stay in L2 while every row of x meets them
constexpr int64_t TILE_CODE_BYTES = 256 << 10;
// weight rows and rows of x per step: R x MB fp32 totals in registers beside R codes' magnitudes and signs, R scales
// and one vector of x (16 ymm registers)
constexpr int R_ROWS = 2;
constexpr int MB_MAX = 3;

// R weight rows (from n) against MB rows of x (from m) of one tile. ONE: groups of one block (Q8_0), whose sums go
// straight into the totals (the batch-1 kernel's acc from zero plus one block is that block's sum)
template <int MB, bool ONE>
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
    for (int64_t b = 0; b < (ONE ? 1 : blocks); ++b) {
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
          const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[r], _mm256_sign_epi8(x, sgn[r])), ones);
          if constexpr (ONE) total[r * MB + j] = _mm256_fmadd_ps(s[r], _mm256_cvtepi32_ps(sum), total[r * MB + j]);
          else acc[r * MB + j] = _mm256_add_epi32(acc[r * MB + j], sum);
        }
      }
    }
    if constexpr (!ONE) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < MB; ++j)
          total[r * MB + j] = _mm256_fmadd_ps(s[r], _mm256_cvtepi32_ps(acc[r * MB + j]), total[r * MB + j]);
    }
  }
  for (int r = 0; r < std::min<int64_t>(R, rows); ++r)
    for (int j = 0; j < MB; ++j) y[(m + j) * N + n + r] = a.d[m + j] * simd::hsum8(total[r * MB + j]);
}

// one pass of MB rows of x over a tile's weight rows [t0, t1); meanwhile the lines [l0, l1) of each row of the next
// tile (up to t1 + ahead) are prefetched into L2, as tiled_rows does, so the next tile's passes do not wait for memory
template <int MB, bool ONE>
AVX2_ISA void tile_pass(const Act16& a, const QuantView& w, int64_t t0, int64_t t1, int64_t ahead, int64_t l0,
                        int64_t l1, int64_t m, float* y, int64_t N) {
  for (int64_t n = t0; n < t1; n += R_ROWS) {
    for (int64_t r = n; r < std::min(n + R_ROWS, t0 + ahead); ++r) {
      const uint8_t* next = w.codes + (r + (t1 - t0)) * w.row_bytes;
      for (int64_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T1);
    }
    pass<MB, ONE>(a, w, n, std::min<int64_t>(R_ROWS, t1 - n), m, y, N);
  }
}

template <bool ONE>
void rows_tiled(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t tile = std::max<int64_t>(R_ROWS, TILE_CODE_BYTES / w.row_bytes / R_ROWS * R_ROWS);
  const int64_t passes = (M + MB_MAX - 1) / MB_MAX, lines = (w.row_bytes + 63) / 64;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile), ahead = std::min(n1, t1 + (t1 - t0)) - t1;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m = p * MB_MAX, l0 = lines * p / passes, l1 = lines * (p + 1) / passes;
      static_assert(MB_MAX == 3, "one case per pass size");
      switch (std::min<int64_t>(MB_MAX, M - m)) {
        case 1: tile_pass<1, ONE>(a, w, t0, t1, ahead, l0, l1, m, y, N); break;
        case 2: tile_pass<2, ONE>(a, w, t0, t1, ahead, l0, l1, m, y, N); break;
        default: tile_pass<3, ONE>(a, w, t0, t1, ahead, l0, l1, m, y, N); break;
      }
    }
  }
}

}  // namespace

template <int F>
void rows_bytes8_blocked_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y,
                              int64_t N) {
  if constexpr (F == INT8) {
    if (w.group == BLOCK) rows_tiled<true>(a, M, w, n0, n1, y, N);
    else rows_tiled<false>(a, M, w, n0, n1, y, N);
  }
}

#define ROWS_BYTES8_BLOCKED(F) \
  template void rows_bytes8_blocked_avx2<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, float*, int64_t);
ROWS_BYTES8_BLOCKED(INT8)
ROWS_BYTES8_BLOCKED(UINT8)
ROWS_BYTES8_BLOCKED(INT4)
ROWS_BYTES8_BLOCKED(UINT4)
ROWS_BYTES8_BLOCKED(UINT4_MIN)

}  // namespace qgemv
