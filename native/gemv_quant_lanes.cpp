// The quantized GEMV's AVX-512 VNNI kernel for many rows of x at int8 (activate_quant) with groups smaller than a
// chunk (32 .. 256): codes in lanes of blocks. Called by gemv_quant_avx512.cpp's rows_avx512 from LANES_MIN_ROWS rows.
//
// The NIBBLES8W kernel (gemv_quant_avx512.cpp) leaves four int32 partial sums of each block of 32 in a 128-bit lane
// and reduces them per (weight row, row of x) with a tree of unpacks, then takes the zero point off with x's block
// sums: ~15 vector instructions beside every 8 vpdpbusd. Zen 4 issues one 512-bit vpdpbusd a cycle
// (benchmarks/vnni_peak.py), and at many rows of x those other instructions set the pace. Here every int32 lane of
// every vpdpbusd holds one block: per 512 k (a chunk) the 8 vectors keep block 4L + b in dword 4b + L (the other
// kernel's lane order), vector q its bytes 4q .. 4q + 3, vector 4 + q bytes 16 + 4q .., so one accumulator per
// (weight row, row of x) gathers the chunk's 16 block sums with no tree. Weight rows are brought into that order a
// tile at a time (in-lane dword transposes), once for all rows of x, as signed bytes with the zero point taken off
// (code - z: INT4's 8, UINT4's zero point; INT8 and UINT4_MIN's codes as they are), beside the 16 block scales in
// fp32 and the row's own correction: x goes in as unsigned bytes x + 128, so each block sum would hold 128 times the
// block's sum of codes too, which the weight row knows: the sums start from minus that. Per (weight row, row of x)
// and chunk that leaves one conversion and one FMA (UINT4_MIN: a second FMA, its mins times x's block sums, first).
// Every block sum is an exact int32 as in the other kernels (|code - z| <= 128, x + 128 <= 255), each lane scales
// its blocks chunk after chunk and the lanes are added up as gemv_quant_avx512.cpp does, so a row's result is the
// same bits as that kernel's at fewer rows: it does not depend on how many other rows there are.
// UINT8's code - z does not fit a byte: it stays with the other kernel.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv_quant.h"
#include "simd.h"

namespace qgemv {
namespace {

#define LANES_ISA __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// a weight row's chunk in the scratch: the 8 code vectors, the 16 corrections (int32, what each block sum starts
// from), scales (fp32), mins (fp32)
constexpr int64_t CORR_AT = CHUNK, SCALE_AT = CHUNK + 64, MIN_AT = CHUNK + 128;
constexpr int64_t ROW_CHUNK_BYTES = CHUNK + 192;
// a row of x's chunk: the 8 vectors of x + 128, then (UINT4_MIN) its 16 block sums in fp32
constexpr int64_t X_CHUNK_BYTES = CHUNK + 64;
// weight rows transformed at a time: their scratch stays in L2 while every row of x meets them
constexpr int64_t LANES_TILE_BYTES = 256 << 10;

// four vectors' dwords transposed inside each 128-bit lane: v[q] dword 4b + L <- v[L] dword 4b + q
LANES_ISA inline void transpose_lanes(__m512i v[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
  v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

// a chunk as NIBBLES8W's halves (lo[L] / hi[L]: the first / last 16 bytes of blocks 4L .. 4L + 3, block 4L + b in
// 128-bit lane b) -> the 8 vectors of lanes of blocks: in every one, dword 4b + L belongs to block 4L + b (the lane
// order of the other AVX-512 kernel's block sums), vector q holds its bytes 4q .. 4q + 3, vector 4 + q 16 + 4q ..
LANES_ISA inline void to_lanes(__m512i lo[4], __m512i hi[4], __m512i T[8]) {
  transpose_lanes(lo);
  transpose_lanes(hi);
  for (int q = 0; q < 4; ++q) T[q] = lo[q], T[4 + q] = hi[q];
}

// the 16 blocks' values of a per-group fp16 row (scales or mins) from group g0 on, in the lanes' block order (gidx)
LANES_ISA inline __m512 per_block(const at::Half* row, int64_t g0, int64_t groups, __m512i gidx) {
  const int64_t count = std::min<int64_t>(16, groups - g0);
  const __mmask16 gm = static_cast<__mmask16>((1u << count) - 1);
  return _mm512_permutexvar_ps(gidx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, row + g0)));
}

// the lanes whose block (4 (lane % 4) + lane / 4) is one of the chunk's first `blocks`
inline __mmask16 lanes_of_blocks(int64_t blocks) {
  if (blocks >= 16) return 0xFFFF;
  unsigned m = 0;
  for (int lane = 0; lane < 16; ++lane) m |= (4 * (lane % 4) + lane / 4 < blocks ? 1u : 0u) << lane;
  return static_cast<__mmask16>(m);
}

// weight row n's chunk at k0 into the scratch layout (out: ROW_CHUNK_BYTES)
template <int F>
LANES_ISA void transform_chunk(const QuantView& w, int64_t n, int64_t k0, int64_t K, __m512i gidx, uint8_t* out) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const __mmask16 valid = lanes_of_blocks((K - k0) / BLOCK);   // grouped weights: K is whole blocks
  __m512i lo[4], hi[4], T[8];
  for (int L = 0; L < 4; ++L) {
    const int64_t k = k0 + 128 * L;
    if constexpr (FOUR_BIT<F>) {   // 128-bit lane b: block b's 16 bytes, codes j (low nibble) and 16 + j (high)
      const __m512i nib = _mm512_set1_epi8(0x0F);
      const __m512i v = _mm512_maskz_loadu_epi8(bytes_mask((K - k) / 2), row + k / 2);
      lo[L] = _mm512_and_si512(v, nib), hi[L] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    } else {   // two loads of 64 codes in k order, regrouped into the halves of 4 blocks
      const __m512i v0 = _mm512_maskz_loadu_epi8(bytes_mask(K - k), row + k);
      const __m512i v1 = _mm512_maskz_loadu_epi8(bytes_mask(K - k - 64), row + k + 64);
      lo[L] = _mm512_shuffle_i64x2(v0, v1, 0x88), hi[L] = _mm512_shuffle_i64x2(v0, v1, 0xDD);
    }
  }
  to_lanes(lo, hi, T);
  const int64_t g0 = k0 / w.group;
  __m512i zb = _mm512_setzero_si512();   // the zero point of each lane's block, in all four bytes
  if constexpr (F == INT4) zb = _mm512_set1_epi8(8);
  if constexpr (F == UINT4) {
    const int64_t count = std::min<int64_t>(16, w.groups - g0);
    const __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1),
                                                                 w.zeros + n * w.groups + g0));
    zb = _mm512_mullo_epi32(_mm512_permutexvar_epi32(gidx, z), _mm512_set1_epi32(0x01010101));
  }
  __m512i codesum = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int j = 0; j < 8; ++j) {
    if constexpr (F == INT4 || F == UINT4) T[j] = _mm512_sub_epi8(T[j], zb);
    if (valid != 0xFFFF) T[j] = _mm512_maskz_mov_epi32(valid, T[j]);   // the last chunk's blocks past K
    _mm512_storeu_si512(out + 64 * j, T[j]);
    codesum = _mm512_dpbusd_epi32(codesum, ones, T[j]);
  }
  // minus 128 times each block's sum of codes: the accumulators of x + 128 start from it
  _mm512_storeu_si512(out + CORR_AT, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(codesum, 7)));
  _mm512_storeu_ps(out + SCALE_AT, per_block(w.scales + n * w.groups, g0, w.groups, gidx));
  if constexpr (HAS_MIN<F>) _mm512_storeu_ps(out + MIN_AT, per_block(w.mins + n * w.groups, g0, w.groups, gidx));
}

// row m of x (NIBBLES8W bytes) into lanes of blocks as x + 128 (out: chunks * X_CHUNK_BYTES); SUMS: with its block
// sums in fp32
template <bool SUMS>
LANES_ISA void transform_x(const int8_t* q8, int64_t chunks, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i lo[4], hi[4], T[8];
    for (int L = 0; L < 4; ++L)
      lo[L] = _mm512_loadu_si512(q8 + c * CHUNK + 128 * L), hi[L] = _mm512_loadu_si512(q8 + c * CHUNK + 128 * L + 64);
    to_lanes(lo, hi, T);
    uint8_t* o = out + c * X_CHUNK_BYTES;
    __m512i sums = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      if constexpr (SUMS) sums = _mm512_dpbusd_epi32(sums, ones, T[j]);   // ones as the unsigned side: sum of x
      _mm512_storeu_si512(o + 64 * j, _mm512_xor_si512(T[j], flip));
    }
    if constexpr (SUMS) _mm512_storeu_ps(o + CHUNK, _mm512_cvtepi32_ps(sums));
  }
}

// the sums of the 16 lanes of 8 vectors, sharing the shuffles and adds
LANES_ISA inline void lane_sums8(const __m512* v, float* out) {
  __m512 t[4], u[2];
  for (int i = 0; i < 4; ++i)   // lanes 0-7: vector 2i's halves added, 8-15: vector 2i + 1's
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)   // 128-bit lane l: four partial sums of vector 4i + l
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));   // lane 4l: vector l's sum, lane 4l + 1: vector 4 + l's
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int l = 0; l < 4; ++l) out[l] = lanes[4 * l], out[4 + l] = lanes[4 * l + 1];
}

// the sums of the 16 lanes of each of n vectors (eight at a time)
LANES_ISA inline void lane_sums(const __m512* v, int n, float* out) {
  for (int i = 0; i < n; i += 8) {
    __m512 eight[8];
    for (int j = 0; j < 8; ++j) eight[j] = i + j < n ? v[i + j] : _mm512_setzero_ps();
    float sums[8];
    lane_sums8(eight, sums);
    for (int j = 0; j < 8 && i + j < n; ++j) out[i + j] = sums[j];
  }
}

// weight rows met per step of a pass: R rows of a tile against MB <= MR rows of x keep R * MB int32 block sums and
// as many fp32 totals in registers (3 x 4: 24 of the 32 vectors, beside R codes and one x)
constexpr int R_ROWS = 3;

// rows [0, rows) of a tile's scratch (row_scratch bytes apart) against rows xr[0..MB) of x (lanes of blocks), R_ROWS
// weight rows at a time: y[m * N + r] = d[m] * (the sum over the chunks of each block's scaled sum). Per chunk and
// (weight row, row of x): 8 vpdpbusd from the row's correction, one conversion and one FMA (UINT4_MIN: a second)
template <int F, int MB>
LANES_ISA void dot_pass(const uint8_t* ws, int64_t row_scratch, int64_t rows, const uint8_t* const* xr, int64_t chunks,
                        const float* d, float* y, int64_t N, const uint8_t* pf, int64_t pf_lines) {
  constexpr int R = R_ROWS;
  const int64_t steps = (rows + R - 1) / R, per_step = (pf_lines + steps - 1) / steps;
  for (int64_t n = 0; n < rows; n += R) {
    for (int64_t l = 0; l < per_step && pf_lines > 0; ++l, --pf_lines, pf += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T1);
    const uint8_t* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = ws + std::min<int64_t>(n + r, rows - 1) * row_scratch;
    __m512 total[R * MB];
#pragma GCC unroll 12
    for (int i = 0; i < R * MB; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i S[R * MB];
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m512i corr = _mm512_loadu_si512(wr[r] + c * ROW_CHUNK_BYTES + CORR_AT);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) S[r * MB + m] = corr;
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i codes[R];
#pragma GCC unroll 3
        for (int r = 0; r < R; ++r) codes[r] = _mm512_loadu_si512(wr[r] + c * ROW_CHUNK_BYTES + 64 * j);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = _mm512_loadu_si512(xr[m] + c * X_CHUNK_BYTES + 64 * j);
#pragma GCC unroll 3
          for (int r = 0; r < R; ++r) S[r * MB + m] = _mm512_dpbusd_epi32(S[r * MB + m], xv, codes[r]);
        }
      }
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const uint8_t* rc = wr[r] + c * ROW_CHUNK_BYTES;
        const __m512 scale = _mm512_loadu_ps(rc + SCALE_AT);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {   // the min term first, then the codes': gemv_quant_avx512.cpp's order
          if constexpr (HAS_MIN<F>)
            total[r * MB + m] = _mm512_fmadd_ps(_mm512_loadu_ps(rc + MIN_AT),
                                                _mm512_loadu_ps(xr[m] + c * X_CHUNK_BYTES + CHUNK), total[r * MB + m]);
          total[r * MB + m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(S[r * MB + m]), total[r * MB + m]);
        }
      }
    }
    float sums[R * MB];
    lane_sums(total, R * MB, sums);
    for (int r = 0; r < std::min<int64_t>(R, rows - n); ++r)
      for (int m = 0; m < MB; ++m) y[m * N + n + r] = d[m] * sums[r * MB + m];
  }
}

template <int F>
LANES_ISA void dot_pass_mb(int64_t mb, const uint8_t* ws, int64_t row_scratch, int64_t rows, const uint8_t* const* xr,
                           int64_t chunks, const float* d, float* y, int64_t N, const uint8_t* pf,
                           int64_t pf_lines) {
  switch (mb) {
    case 1: dot_pass<F, 1>(ws, row_scratch, rows, xr, chunks, d, y, N, pf, pf_lines); break;
    case 2: dot_pass<F, 2>(ws, row_scratch, rows, xr, chunks, d, y, N, pf, pf_lines); break;
    case 3: dot_pass<F, 3>(ws, row_scratch, rows, xr, chunks, d, y, N, pf, pf_lines); break;
    default: dot_pass<F, 4>(ws, row_scratch, rows, xr, chunks, d, y, N, pf, pf_lines); break;
  }
}

// weight rows [r0, r1)'s per-group values (scales; zero points or mins) into L2 ahead of their transform: they lie
// apart from the codes, which dot_pass brings in a tile ahead, and waiting for them took a fifth of the transform's
// time at 32 rows of x
LANES_ISA inline void prefetch_groups(const QuantView& w, int64_t r0, int64_t r1) {
  if (r1 <= r0) return;
  simd::prefetch_row<2>(w.scales + r0 * w.groups, (r1 - r0) * w.groups * 2);
  if (w.zeros) simd::prefetch_row<2>(w.zeros + r0 * w.groups, (r1 - r0) * w.groups);
  if (w.mins) simd::prefetch_row<2>(w.mins + r0 * w.groups, (r1 - r0) * w.groups * 2);
}

// rows of x per block: each block's x in lanes (M_BLOCK * chunks * X_CHUNK_BYTES) is made once and met by every tile
// of weight rows, which are brought into lanes again for every block (a few percent of a block's multiply-adds)
constexpr int64_t M_BLOCK = 256;

template <int F>
LANES_ISA void rows_lanes_isa(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1,
                              float* y, int64_t N, const FinishBlock* finish) {
  const int64_t chunks = a.padded / CHUNK, row_scratch = chunks * ROW_CHUNK_BYTES;
  thread_local LineVector<uint8_t> xs, ws;   // the vectors of their rows (multiples of 64 bytes) align
  // with finish: a block's sums for a tile (at most M_BLOCK x tile fp32, in L2) instead of y's M x N, which a
  // prompt step of 1024 rows and 8192 columns would write to memory and read back to round them
  thread_local LineVector<float> ys;
  const int64_t tile = std::max<int64_t>(R_ROWS, LANES_TILE_BYTES / row_scratch / R_ROWS * R_ROWS);
  ws.resize(std::min(tile, n1 - n0) * row_scratch);
  xs.resize(std::min(M, M_BLOCK) * chunks * X_CHUNK_BYTES);
  if (finish) ys.resize(std::min(M, M_BLOCK) * tile);
  alignas(64) int32_t idx[16];
  for (int lane = 0; lane < 16; ++lane) idx[lane] = (4 * (lane % 4) + lane / 4) / static_cast<int>(w.group / BLOCK);
  const __m512i gidx = _mm512_load_si512(idx);
  // the first tile's codes and groups come in while x is brought into lanes; each later one's a tile ahead
  simd::prefetch_row<2>(w.codes + n0 * w.row_bytes, (std::min(n1, n0 + tile) - n0) * w.row_bytes);
  prefetch_groups(w, n0, std::min(n1, n0 + tile));
  for (int64_t b0 = 0; b0 < M; b0 += M_BLOCK) {
    const int64_t bm = std::min(M_BLOCK, M - b0), passes = (bm + MR - 1) / MR;
    for (int64_t m = 0; m < bm; ++m)
      transform_x<HAS_MIN<F>>(a.q8.data() + (b0 + m) * a.padded, chunks, xs.data() + m * chunks * X_CHUNK_BYTES);
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile), next = std::min(n1, t1 + tile) - t1;
      prefetch_groups(w, t1, t1 + next);
      for (int64_t n = t0; n < t1; ++n)
        for (int64_t c = 0; c < chunks; ++c)
          transform_chunk<F>(w, n, c * CHUNK, K, gidx, ws.data() + (n - t0) * row_scratch + c * ROW_CHUNK_BYTES);
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t m0 = p * MR, mb = std::min(MR, bm - m0);
        // the next tile's codes (one run of memory) into L2, a share per pass, spread over this pass's rows
        const uint8_t* ahead = w.codes + t1 * w.row_bytes;
        const int64_t bytes = next * w.row_bytes, pf0 = bytes * p / passes / 64 * 64;
        const int64_t pf1 = bytes * (p + 1) / passes / 64 * 64;
        const uint8_t* xr[MR];
        for (int64_t m = 0; m < mb; ++m) xr[m] = xs.data() + (m0 + m) * chunks * X_CHUNK_BYTES;
        float* out = finish ? ys.data() + m0 * tile : y + (b0 + m0) * N + t0;
        dot_pass_mb<F>(mb, ws.data(), row_scratch, t1 - t0, xr, chunks, a.d.data() + b0 + m0, out,
                       finish ? tile : N, ahead + pf0, (pf1 - pf0) / 64);
      }
      if (finish) (*finish)(ys.data(), tile, b0, b0 + bm, t0, t1);
    }
  }
}

}  // namespace

template <int F>
void rows_lanes(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                int64_t N, const FinishBlock* finish) {
  rows_lanes_isa<F>(a, M, w, K, n0, n1, y, N, finish);
}

#define ROWS_LANES(F)                                                                                            \
  template void rows_lanes<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, int64_t, float*, int64_t, \
                              const FinishBlock*);
ROWS_LANES(INT8)
ROWS_LANES(INT4)
ROWS_LANES(UINT4)
ROWS_LANES(UINT4_MIN)

}  // namespace qgemv
