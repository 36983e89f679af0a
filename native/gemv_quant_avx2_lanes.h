// The lanes layout the AVX2 many-row kernels share (gemv_quant_avx2_lanes.cpp: 4-bit codes;
// gemv_quant_avx2_bytes8.cpp: int8 codes): a unit of eight groups of 32 in 8 vectors whose int32 lane j holds 4
// values of group GROUP_OF_LANE[j], so products summed over the 8 vectors leave each group's exact sum in its lane;
// and the driver both run (lanes_rows).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemv_quant.h"
#include "simd.h"

namespace qgemv {

// four vectors' dwords transposed inside each 128-bit lane: v[q] dword L <- v[L] dword q
__attribute__((target("avx2,fma,f16c"))) inline void transpose_lanes(__m256i v[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Eight groups from the 32-byte runs lo[c] / hi[c] (c < 4: groups 2c in the low 128 bits, 2c + 1 in the high; dword d
// of a half: its group's 4 values at positions 4d .. 4d + 3 of the run) into the lanes layout at out
__attribute__((target("avx2,fma,f16c"))) inline void store_lanes(__m256i lo[4], __m256i hi[4], uint8_t* out) {
  transpose_lanes(lo);
  transpose_lanes(hi);
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * q), lo[q]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + q)), hi[q]);
  }
}

// the lane order of a unit's groups: lane j holds group (0, 2, 4, 6, 1, 3, 5, 7)[j]
constexpr int GROUP_OF_LANE[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// rows of x per block: made into lanes once, met by every tile of weight rows
constexpr int64_t LANES_X_BLOCK = 256;

// A pass: a tile's weight rows in lanes against up to MB_MAX rows of x in lanes
template <int MB_MAX>
struct LanesPass {
  const uint8_t* ws;              // the tile's weight rows in lanes, w_row bytes apart
  int64_t w_row, x_row, rows, n0;  // scratch bytes per weight row and per row of x; the tile's rows, its first one
  const uint8_t* xr[MB_MAX];      // the pass's rows of x in lanes
  int64_t xm[MB_MAX];             // ... and their indices in x
  int64_t full, tail;             // whole units, and groups after them
  float* y;                       // where (row of x y_row0, weight row n0)'s result goes; rows ld apart
  int64_t ld, y_row0;
};

// A pass as both kernels run it: R weight rows at a time, for each whole unit sums(wu, xc, S) (the unit's exact group
// sums per (weight row, row of x)) then add(S, wu, xc, total) (scaled into the fp32 totals); the left-over groups'
// sums kept by lane, rest(n, m, lanes) (their terms for weight row n and the pass's row of x m, one group at a
// time); each result d * (hsum8(total) + rest) into the pass's output. Called from a kernel's out-of-line pass.
template <int R, int MB, int MB_MAX, typename Sums, typename Add, typename Rest>
__attribute__((target("avx2,fma,f16c"))) inline void lanes_pass_steps(const LanesPass<MB_MAX>& p, const float* d,
                                                                       int64_t w_unit_bytes, int64_t x_unit_bytes,
                                                                       Sums sums, Add add, Rest rest) {
  for (int64_t i = 0; i < p.rows; i += R) {
    const uint8_t* wc[R];
    for (int r = 0; r < R; ++r) wc[r] = p.ws + std::min<int64_t>(i + r, p.rows - 1) * p.w_row;
    __m256 total[R * MB];
#pragma GCC unroll 8
    for (int j = 0; j < R * MB; ++j) total[j] = _mm256_setzero_ps();
    const uint8_t* xc[MB];
    const uint8_t* wu[R];
    const auto unit = [&](int64_t u) {
      for (int m = 0; m < MB; ++m) xc[m] = p.xr[m] + u * x_unit_bytes;
      for (int r = 0; r < R; ++r) wu[r] = wc[r] + u * w_unit_bytes;
    };
    for (int64_t u = 0; u < p.full; ++u) {
      unit(u);
      __m256i S[R * MB];
      sums(wu, xc, S);
      add(S, wu, xc, total);
    }
    alignas(32) int32_t left[R * MB][8];
    if (p.tail) {
      unit(p.full);
      __m256i S[R * MB];
      sums(wu, xc, S);
      for (int j = 0; j < R * MB; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(left[j]), S[j]);
    }
    for (int r = 0; r < std::min<int64_t>(R, p.rows - i); ++r) {
      const int64_t n = p.n0 + i + r;
      for (int m = 0; m < MB; ++m) {
        const float tail_terms = p.tail ? rest(n, m, left[r * MB + m]) : 0.f;
        p.y[(p.xm[m] - p.y_row0) * p.ld + n - p.n0] = d[p.xm[m]] * (simd::hsum8(total[r * MB + m]) + tail_terms);
      }
    }
  }
}

// Rows [n0, n1) of y for M rows of x, as both AVX2 lanes kernels run them: rows of x LANES_X_BLOCK at a time made
// into lanes once (x_unit(m, u, out): row m's unit u), weight rows a tile at a time (TILE_BYTES of scratch, a multiple
// of R rows) made into lanes (w_unit(n, u, out)) and met by every pass of up to MB_MAX rows of x (pass(mb, p)). With
// finish, a block's sums for a tile go to a tile-sized buffer that finish rounds into the output (gemv_quant_lanes.cpp
// says why), else straight to y. The three take the AVX2 target too (lanes_rows' callers: AVX2_ISA on each lambda),
// so that they inline here as one AVX2 function.
template <int R, int MB_MAX, typename XUnit, typename WUnit, typename Pass>
__attribute__((target("avx2,fma,f16c"))) inline void lanes_rows(int64_t M, int64_t groups, int64_t n0, int64_t n1,
                                                                 int64_t w_unit_bytes, int64_t x_unit_bytes, float* y,
                                                                 int64_t N, const FinishBlock* finish, XUnit x_unit,
                                                                 WUnit w_unit, Pass pass) {
  const int64_t full = groups / 8, tail = groups % 8, units = full + (tail ? 1 : 0);
  const int64_t w_row = units * w_unit_bytes, x_row = units * x_unit_bytes;
  thread_local LineVector<uint8_t> xs, ws;
  thread_local LineVector<float> ys;
  const int64_t tile = std::max<int64_t>(R, TILE_BYTES / w_row / R * R);
  ws.resize(std::min(tile, n1 - n0) * w_row);
  xs.resize(std::min(M, LANES_X_BLOCK) * x_row);
  if (finish) ys.resize(std::min(M, LANES_X_BLOCK) * tile);
  for (int64_t b0 = 0; b0 < M; b0 += LANES_X_BLOCK) {
    const int64_t bm = std::min(LANES_X_BLOCK, M - b0);
    for (int64_t m = 0; m < bm; ++m)
      for (int64_t u = 0; u < units; ++u) x_unit(b0 + m, u, xs.data() + m * x_row + u * x_unit_bytes);
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t n = t0; n < t1; ++n)
        for (int64_t u = 0; u < units; ++u) w_unit(n, u, ws.data() + (n - t0) * w_row + u * w_unit_bytes);
      for (int64_t m0 = 0; m0 < bm; m0 += MB_MAX) {
        const int64_t mb = std::min<int64_t>(MB_MAX, bm - m0);
        LanesPass<MB_MAX> p{ws.data(), w_row, x_row, t1 - t0, t0, {}, {}, full, tail,
                            finish ? ys.data() : y + t0, finish ? tile : N, finish ? b0 : 0};
        for (int64_t m = 0; m < mb; ++m) p.xr[m] = xs.data() + (m0 + m) * x_row, p.xm[m] = b0 + m0 + m;
        pass(mb, p);
      }
      if (finish) (*finish)(ys.data(), tile, b0, b0 + bm, t0, t1);
    }
  }
}

}  // namespace qgemv
