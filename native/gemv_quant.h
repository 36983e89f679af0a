// What the quantized GEMV's files share (gemv_quant.cpp: portable kernel, dequantization and the entry points;
// activation_rounding.cpp: rounding x; gemv_quant_avx2.cpp: the AVX2 kernels; gemv_quant_avx512.cpp: the AVX-512
// VNNI kernel): block and chunk sizes, the formats, x rounded to int16 (Act16) and the order it is stored in,
// reading codes, and the kernels' entry points. Layouts: gemv_quant.cpp's header comment.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <new>
#include <vector>

#include "kernels.h"

namespace qgemv {


constexpr int64_t MR = 4;      // x rows sharing each widened block of codes
constexpr int64_t MR_ONE_PASS = 5;   // the AVX-512 kernel: up to this many rows of x in one pass
constexpr int64_t BLOCK = 32;  // k per block of codes (and of x's 16-bit rounding)
// k per exact int32 partial sum: |(code - zero) * q| <= 255 * 32767, and an int32 lane sums 128 of them per 1024 k
constexpr int64_t FLUSH = 1024;
constexpr int64_t CHUNK = 512;  // k per step of the AVX-512 kernel: 16 blocks whose sums are reduced together
constexpr float ACT_MAX = 32767.f;     // x rounded to 16 bits (weight-only); activate_quant: 127

// UINT4_MIN (llama.cpp's Q4_1 block): w = code * scale + min with an fp16 min per group (QuantView::mins); its codes
// meet x with no zero point and the kernels add min * (sum of q over the group) to each group's scaled sum
enum Format : int64_t { INT8 = 0, UINT8 = 1, INT4 = 2, UINT4 = 3, UINT4_MIN = 4 };
// bits per code (4-bit codes: two a byte)
template <int F> constexpr bool FOUR_BIT = F == INT4 || F == UINT4 || F == UINT4_MIN;
template <int F> constexpr int64_t CODE_BITS = FOUR_BIT<F> ? 4 : 8;
template <int F> constexpr bool HAS_MIN = F == UINT4_MIN;

inline float half_to_float(at::Half h) { return static_cast<float>(h); }

// Where a row of x sits in Act16::q. NATURAL: k in order (portable and AVX2 kernels). The AVX-512 kernel
// reads 64 bytes of codes at a time as 32 16-bit words and isolates each word's codes with shifts and masks,
// so x is stored in the order those codes come out (the rounding is the same, only the order differs):
//   PAIRS (8-bit, per 64 k): word i holds k = 2i (low byte), 2i + 1 (high byte): q[2i] x 32, then q[2i + 1] x 32
//   NIBBLES (4-bit, per 128 k = 4 blocks): word i is bytes 2j, 2j + 1 of block b = i / 8 (j = i % 8), i.e. its
//   four nibbles are k = 32b + {2j, 16 + 2j, 2j + 1, 17 + 2j}: four vectors of 32, one per nibble position.
//   8-bit codes in groups of 32..256 take it too: their two 64-byte loads per 128 k are regrouped (per weight row,
//   not per row of x) so that 128-bit lane b holds 16 codes of block b, k = 32b + 2j + {0, 1} and 32b + 16 + 2j +
//   {0, 1}: every product lands in its block's lane, as with 4-bit codes
//   NIBBLES16 (AVX2, 4-bit, per 64 k = 2 blocks): the same idea in a 256-bit vector: word i is bytes 2j, 2j + 1 of
//   block b = i / 8 (j = i % 8), four vectors of 16, one per nibble position, k = 32b + {2j, 16 + 2j, 2j + 1, 17 + 2j}
//   NIBBLES8 (AVX2, 4-bit, activate_quant's int8 x, per 64 k = 2 blocks): x as bytes in the order of 32 bytes of
//   codes split into their low and their high nibbles: k = 32b + 16h + j at byte 32h + 16b + j (h the nibble,
//   b the block, j < 16); with groups of 64, in each full run of eight groups every pair (g, g + 1) has its runs
//   of 16 bytes interleaved: g's run 0, g+1's run 0, g's run 2, g+1's run 2, then runs 1 and 3 the same way
//   (the batch-1 kernel then meets the two groups' blocks b in one vector, its halves loaded separately)
//   BYTES8 (AVX2, 8-bit codes, activate_quant's int8 x, batch 1): x as bytes in k order
//   NIBBLES8W (AVX-512 VNNI, activate_quant's int8 x): NIBBLES8's order over 128 k (4 blocks): x as
//   bytes in the order of 64 bytes of codes split into their low and their high nibbles, k = 32b + 16h + j at byte
//   64h + 16b + j (h the nibble, b < 4 the block, j < 16), so that vpdpbusd meets each code with its x. 8-bit codes
//   (grouped or per channel) take it too: their two 64-byte loads per 128 k are regrouped so that 128-bit lane b
//   holds block b's first 16 codes (h = 0), then its last 16 (h = 1)
enum Layout { NATURAL, PAIRS, NIBBLES, NIBBLES16, NIBBLES8, BYTES8, NIBBLES8W };
constexpr int64_t CHUNK16 = 64;   // k per step of the AVX2 NIBBLES16 kernel

// x rounded per row to int16: q [M, padded K] (zero padded) and one scale d per row
// std::vector's storage from a cache line on: a 64-byte vector load from a buffer of them then never straddles two
// lines, which costs it twice (malloc aligns to 16 bytes, and a large block sits 16 bytes past a page). The int8 x and
// the GEMV scratch buffers are read a 64-byte vector at a time.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

struct Act16 {
  LineVector<int16_t> q;
  // [M, padded K / 32]: sum of q over each block of 32 (for the zero points); PAIRS / NIBBLES / NIBBLES8W: each
  // chunk's 16 in the lane order of the AVX-512 kernel's reduction (lane 4b + s holds block 4s + b)
  std::vector<int32_t> block_sum;
  std::vector<int32_t> chunk_sum;   // PAIRS / NIBBLES / NIBBLES8W: [M, padded K / CHUNK], sum of q over each chunk
  // NIBBLES16 / NIBBLES8: block_sum with each 8 blocks in the order 0, 2, 4, 6, 1, 3, 5, 7, the lane order in which
  // the batch-1 kernel's reduction leaves groups of 32 (so their sums are never permuted back)
  std::vector<int32_t> block_sum_lanes;
  // NIBBLES16 / NIBBLES8 with groups of 64 or 128: [M, groups] sum of q over each group, so the batch-1 kernel
  // takes a group's zero point off without adding up its block sums again for every weight row (NIBBLES8 with
  // groups of 64: each full eight in the lane order of block_sum_lanes)
  std::vector<int32_t> group_sum;
  LineVector<int8_t> q8;           // NIBBLES8 / BYTES8 / NIBBLES8W: q as bytes (q itself then left empty)
  std::vector<float> d;
  int64_t padded;
};
template <int F>
inline int code_at(const uint8_t* row, int64_t k) {
  if constexpr (F == INT8) return static_cast<int8_t>(row[k]);
  else if constexpr (F == UINT8) return row[k];
  else {
    const uint8_t b = row[(k / BLOCK) * (BLOCK / 2) + (k % BLOCK) % (BLOCK / 2)];
    return (k % BLOCK) < BLOCK / 2 ? (b & 0xF) : (b >> 4);
  }
}

template <int F>
inline int zero_of(const uint8_t* zeros_row, int64_t g) {
  if constexpr (F == UINT8 || F == UINT4) return zeros_row[g];
  else if constexpr (F == INT4) return 8;
  else return 0;
}

// v unchanged, but the compiler can no longer fuse the multiply that made it into a following add: UINT4_MIN's
// dequantization rounds code * scale before adding the min, as the reference (and GGUF's readers) do
template <typename V>
inline void no_contract(V& v) {
  asm("" : "+v"(v));
}

// a group's min (UINT4_MIN), 0 for the other formats
template <int F>
inline float min_of(const at::Half* mins_row, int64_t g) {
  if constexpr (HAS_MIN<F>) return static_cast<float>(mins_row[g]);
  else return 0.f;
}

// the 32 codes of block [k, k + 32) minus the zero point, as int16: lo = k .. k+15, hi = k+16 .. k+31
template <int F>
__attribute__((target("avx2,fma,f16c")))
inline void codes16(const uint8_t* row, int64_t k, __m256i zero, __m256i* lo, __m256i* hi) {
  if constexpr (FOUR_BIT<F>) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k >> 1)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    *lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(b, mask)), zero);
    *hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask)), zero);
  } else {
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
    if constexpr (F == INT8) {
      *lo = _mm256_cvtepi8_epi16(b0), *hi = _mm256_cvtepi8_epi16(b1);
    } else {
      *lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(b0), zero);
      *hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(b1), zero);
    }
  }
}

// the AVX2 NIBBLES16 / NIBBLES8 kernels' weights: 4-bit, groups of 32, 64 or 128, K a multiple of 64 (whole
// chunks), at least 2 groups
inline bool nibbles16_fits(const QuantView& w, int64_t K) {
  return w.format >= INT4 &&
         (w.group == BLOCK || w.group == 2 * BLOCK || w.group == 4 * BLOCK) && w.groups > 1 && K % CHUNK16 == 0;
}

// the AVX2 BYTES8 kernel's weights: 8-bit codes per channel or in groups of a multiple of 32, K a multiple of 32
inline bool bytes8_fits(const QuantView& w, int64_t K) {
  return (w.format == INT8 || w.format == UINT8) && w.group % BLOCK == 0 && K % BLOCK == 0;
}

// rows [n0, n1) of y = x . W^T with the AVX2 kernels (gemv_quant_avx2.cpp): x in the NATURAL layout, any M
template <int F>
void rows_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N);
// the same with the batch-1 kernels, each row of x as alone, for weights that nibbles16_fits, x in the NIBBLES16 layout (or NIBBLES8: activate_quant)
template <int F>
void rows_nibbles_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N,
                       Layout layout);
// the same for weights that bytes8_fits, x in the BYTES8 layout (activate_quant)
template <int F>
void rows_bytes8_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y, int64_t N);

// the mask of the first `bytes` of a 64-byte load (none if bytes <= 0, all if >= 64): the AVX-512 kernels' row ends
inline __mmask64 bytes_mask(int64_t bytes) {
  return bytes >= 64 ? ~__mmask64(0) : bytes <= 0 ? __mmask64(0) : (__mmask64(1) << bytes) - 1;
}

// the weights the AVX-512 kernel takes: per channel, or groups of 32, 64, 128, 256 or a multiple of 512
inline bool avx512_fits(const QuantView& w) {
  return w.groups == 1 || w.group % CHUNK == 0 || w.group == 32 || w.group == 64 || w.group == 128 || w.group == 256;
}

// Decode batches of more rows of x than RX (MR by default): the weight rows in tiles of TILE_BYTES (they stay in L2),
// and every block of RX rows of x (m, mb) meets each row of a tile (row(m, mb, n)) before the next tile: each tile
// comes from memory once, not M / RX times. While pass p of P (one per block of x) runs over a tile, the lines
// [p / P, (p + 1) / P) of each row of the next tile are prefetched into L2, so its first pass does not wait for
// memory. Each (weight row, row of x) pair is still computed exactly as at M <= RX, so a row's result never depends
// on the others. (One weight row per step, not two sharing each load of x: the kernels are bound by their vector
// instructions, not their loads, and 2 x 4 rows spill registers.) RW > 1: RW weight rows a step,
// row(m, mb, n, nw) with nw <= RW of them left in the tile (the AVX2 int8 kernel, gemv_quant_avx2_bytes8.cpp).
constexpr int64_t TILE_BYTES = 256 << 10;
template <int64_t RX = MR, int64_t RW = 1, typename RowFn>
inline void tiled_rows(const QuantView& w, int64_t M, int64_t n0, int64_t n1, RowFn row) {
  const int64_t tile = std::max<int64_t>(RW, TILE_BYTES / std::max<int64_t>(w.row_bytes, 1) / RW * RW);
  const int64_t passes = (M + RX - 1) / RX, lines = (w.row_bytes + 63) / 64;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile), next = std::min(n1, t1 + tile) - t1;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m = p * RX, mb = std::min(RX, M - m);
      const int64_t l0 = lines * p / passes, l1 = lines * (p + 1) / passes;
      for (int64_t n = t0; n < t1; n += RW) {
        for (int64_t r = n; passes > 1 && r < std::min(n + RW, t0 + next); ++r) {
          const uint8_t* ahead = w.codes + (r + tile) * w.row_bytes;
          for (int64_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T1);
        }
        if constexpr (RW == 1) row(m, mb, n);
        else row(m, mb, n, std::min(RW, t1 - n));
      }
    }
  }
}

// one row of x into the PAIRS / NIBBLES layout (q) or NIBBLES8W (q8; |x * inv| <= 127) (gemv_quant_avx512.cpp)
void round_row_avx512(const float* x, int64_t K, int64_t padded, float inv, Layout layout, int16_t* q, int8_t* q8,
                      int32_t* bsum, int32_t* chunk_sum);
// Where a kernel that keeps its sums in a small tile rounds a block of them into the output while they are in cache:
// out[m, c] = tile[(m - m0) * ld + c - c0] (+ bias) for m in [m0, m1), c in [c0, c1), as run_linear rounds y
using FinishBlock = std::function<void(const float* tile, int64_t ld, int64_t m0, int64_t m1, int64_t c0, int64_t c1)>;

// rows [n0, n1) of y = x . W^T with the AVX-512 VNNI kernel (x in the PAIRS / NIBBLES / NIBBLES8W layout); F a
// Format. With `finish` the lanes kernel may round its blocks itself (then true, y untouched)
template <int F>
bool rows_avx512(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                 int64_t N, Layout layout, const FinishBlock* finish = nullptr);

// gemv_quant_lanes.cpp: rows [n0, n1) of y = x . W^T for weights in groups of 32 .. 256 (any format but UINT8) against
// LANES_MIN_ROWS or more rows of int8 x (activate_quant, NIBBLES8W): each block's sum in one lane, no reduction tree.
// Its reordering of each tile of weight rows is shared by all rows of x, so it pays only with enough of them (where it
// starts to: docs/performance.md, "Choices in the code")
constexpr int64_t LANES_MIN_ROWS = 12;
// `finish`: each block of sums goes to a tile of the calling thread and then to finish, not to y
template <int F>
void rows_lanes(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N,
                const FinishBlock* finish = nullptr);

// gemv_quant_avx2_lanes.cpp: rows [n0, n1) of y = x . W^T for 4-bit weights in groups of 32 (nibbles16_fits) against
// AVX2_LANES_MIN_ROWS or more rows of int8 x (activate_quant, NIBBLES8): each group's sum in one int32 lane, a tile of
// weight rows reordered once for all rows of x; every row's bits as the batch-1 kernel's. Below 8 rows the batch-1
// kernel row by row was as fast (every call reorders the weight rows it meets; benchmarks/prefill_gemm.py --as-avx2)
constexpr int64_t AVX2_LANES_MIN_ROWS = 8;
template <int F>
void rows_lanes_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                     int64_t N, const FinishBlock* finish = nullptr);

// gemv_quant_avx2_bytes8.cpp: rows [n0, n1) of y = x . W^T for INT8 codes that bytes8_fits against
// bytes8_blocked_min_rows or more rows of int8 x (activate_quant, BYTES8): R weight rows x MB rows of x a step, every
// pair in the batch-1 kernel's arithmetic (the same bits as alone). Below those counts the batch-1 kernel row by
// row, whose weight stream is prefetched further ahead, was as fast or faster (benchmarks/prefill_gemm.py --as-avx2
// --formats int8:32): groups of 32 go into lanes, which each call reorders for its rows, and pay from 16 rows on
constexpr int64_t AVX2_BYTES8_MIN_ROWS = 4, AVX2_BYTES8_LANES_MIN_ROWS = 16;
inline int64_t bytes8_blocked_min_rows(const QuantView& w) {
  return w.group == BLOCK ? AVX2_BYTES8_LANES_MIN_ROWS : AVX2_BYTES8_MIN_ROWS;
}
// true where it rounded the rows into the output itself (groups of 32 with finish)
template <int F>
bool rows_bytes8_blocked_avx2(const Act16& a, int64_t M, const QuantView& w, int64_t n0, int64_t n1, float* y,
                              int64_t N, const FinishBlock* finish = nullptr);

// activation_rounding.cpp: each row of x [M, K] rounded to fixed point (act_max 32767 or 127) in `layout`, with the
// sums the kernels take the zero points off with (`group`: the weight's group size)
Act16 round_activations(const float* x, int64_t M, int64_t K, int64_t isa, float act_max, Layout layout, int64_t group);
// bf16 -> fp32 (exact)
void widen_bf16(const at::BFloat16* x, int64_t n, float* out, int64_t isa);
// a row's fixed point (activation_rounding.cpp): q = nearbyint(x * inv), x ~ q * d, d = absmax / act_max
struct RowScale {
  float inv, d;
};
RowScale row_scale(const float* x, int64_t K, float act_max, int64_t isa);
// q = nearbyint(x * inv) for n values (AVX2)
__attribute__((target("avx2,fma,f16c"))) void round_row_avx2(const float* x, int64_t n, float inv, int16_t* q);

}  // namespace qgemv
