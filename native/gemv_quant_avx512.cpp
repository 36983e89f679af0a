// The quantized GEMV's AVX-512 VNNI kernel (ISA level 3) and the activation layout it reads; the rest of the
// GEMV, its layout and math are in gemv_quant.cpp, the pieces both share in gemv_quant.h.
//
// int16 x int16 (vpdpwssd, gemv_quant.cpp's exact numerics) rather than uint8 x int8 (vpdpbusd, x rounded to
// int8 as llama.cpp's q8_0 is: a 1/254 activation error, ~1% of the largest output on random 4-bit weights,
// vs ~3e-5) by default: streaming the weights from memory, as decode does, a vpdpbusd variant of this kernel gained
// little over it (it gains with the weights in L2), so rounding x to int8 is left to activate_quant.
// The 4-bit loop is bound by its instructions, not the memory: ~11 per 64-byte line of codes (int16 x int16 takes
// 4 vpdpwssd per 128 codes) against ~6 for bf16, so one core reads less than its bf16 GEMV streams. Hence, at
// M = 1, two weight rows per step from the two halves of each thread's block (two streams, as gemv.cpp's bf16
// kernel), sharing the loads of x.
// activate_quant (x already rounded to int8 by the model's scheme, so nothing changes in the numbers): the codes
// take vpdpbusd, codes as unsigned bytes times x as signed bytes (the NIBBLES8W layout): per 64 bytes of 4-bit codes
// two instead of four vpdpwssd, per 64 bytes of 8-bit codes one instead of two (int8 codes go in as code + 128, the
// 128 taken off with x's block sums as a zero point), and half the bytes of x. 8-bit codes gain from it with many
// rows of x, where the multiply-adds are the bound, not at one row, where the weight's bytes are.
// Groups below a chunk with LANES_MIN_ROWS or more rows of int8 x go to gemv_quant_lanes.cpp instead: each block's
// sum in one lane, no reduction tree and no zero-point work per row of x. Transposing the codes per block of rows of
// x here did not pay; done once per tile of weight rows there, for all rows of x, it does.
// Zen 4 issues one 512-bit vpdpbusd a cycle (benchmarks/vnni_peak.py); this kernel's tree, zero points and
// unpacking take ~15 other vector instructions per 8 vpdpbusd and set its pace at many rows.
// The measurements behind these choices, on the 2-core Zen 4 VM, and what was tried and dropped here (a prefetch of
// the scales, 8 rows of x per call): docs/performance.md, "Choices in the code".
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gemv_quant.h"

namespace qgemv {

// One row of x into the PAIRS / NIBBLES layout (q) or NIBBLES8W (q8) on AVX-512 (isa >= 3; the same rounding as
// round_row_avx2): per chunk, the 16 blocks are rounded in order (block sums from the int32 values), then each 64 /
// 128 k are rearranged with two-source word permutes (NIBBLES8W: narrowed to bytes, 128-bit lanes regrouped).
// q / q8: padded K; bsum: padded K / 32, in the reduction's lane order.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
void round_row_avx512(const float* x, int64_t K, int64_t padded, float inv, Layout layout, int16_t* q, int8_t* q8,
                      int32_t* bsum, int32_t* chunk_sum) {
  alignas(64) int16_t pidx[4][32];   // PAIRS: even / odd words of two blocks; NIBBLES: nibble v of blocks A, B
  alignas(64) int32_t lidx[16];
  constexpr int off[4] = {0, 16, 1, 17};
  for (int i = 0; i < 32; ++i) {
    for (int v = 0; v < 2; ++v) pidx[v][i] = static_cast<int16_t>(2 * i + v);
    for (int v = 0; v < 4 && layout == NIBBLES; ++v)
      pidx[v][i] = static_cast<int16_t>(32 * (i / 8) + off[v] + 2 * (i % 8));
  }
  for (int lane = 0; lane < 16; ++lane) lidx[lane] = 4 * (lane % 4) + lane / 4;
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i lanes = _mm512_load_si512(lidx);
  for (int64_t c0 = 0; c0 < padded; c0 += CHUNK) {
    __m512i V[16];
    alignas(64) int32_t bs[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t k = c0 + 32 * j, left = K - k;
      const __mmask16 m0 = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
      const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m0, x + k), iv));
      const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m1, x + k + 16), iv));
      bs[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
      V[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)), _mm512_cvtepi32_epi16(b), 1);
    }
    if (layout == NIBBLES8W) {   // per 128 k: blocks 0..3 as bytes, each one's first 16 (low nibbles), then its last 16
      for (int u = 0; u < 4; ++u) {
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(V[4 * u])),
                                              _mm512_cvtepi16_epi8(V[4 * u + 1]), 1);
        const __m512i cd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(V[4 * u + 2])),
                                              _mm512_cvtepi16_epi8(V[4 * u + 3]), 1);
        _mm512_storeu_si512(q8 + c0 + 128 * u, _mm512_shuffle_i64x2(ab, cd, 0x88));
        _mm512_storeu_si512(q8 + c0 + 128 * u + 64, _mm512_shuffle_i64x2(ab, cd, 0xDD));
      }
    } else if (layout == PAIRS) {
      int16_t* out = q + c0;
      const __m512i even = _mm512_load_si512(pidx[0]), odd = _mm512_load_si512(pidx[1]);
      for (int u = 0; u < 8; ++u) {
        _mm512_storeu_si512(out + 64 * u, _mm512_permutex2var_epi16(V[2 * u], even, V[2 * u + 1]));
        _mm512_storeu_si512(out + 64 * u + 32, _mm512_permutex2var_epi16(V[2 * u], odd, V[2 * u + 1]));
      }
    } else {
      int16_t* out = q + c0;
      for (int u = 0; u < 4; ++u)
        for (int v = 0; v < 4; ++v) {   // lanes 0-15 from blocks A, B; 16-31 the same words of blocks C, D
          const __m512i idx = _mm512_load_si512(pidx[v]);
          const __m512i ab = _mm512_permutex2var_epi16(V[4 * u], idx, V[4 * u + 1]);
          const __m512i cd = _mm512_permutex2var_epi16(V[4 * u + 2], idx, V[4 * u + 3]);
          _mm512_storeu_si512(out + 128 * u + 32 * v, _mm512_inserti64x4(ab, _mm512_castsi512_si256(cd), 1));
        }
    }
    const __m512i sums = _mm512_load_si512(bs);
    _mm512_storeu_si512(bsum + c0 / BLOCK, _mm512_permutexvar_epi32(lanes, sums));
    chunk_sum[c0 / CHUNK] = _mm512_reduce_add_epi32(sums);
  }
}

namespace {

// ---- AVX-512 VNNI -----------------------------------------------------------------------------
// Per weight row, a chunk of 512 k (16 blocks of 32) at a time. The codes come in as 64-byte loads read as
// 32 16-bit words (x is laid out to match, see Layout): int8 codes are a word's bytes sign-extended by
// shifts, uint8 / 4-bit codes its bytes / nibbles masked out, all still int16 lanes, so no widening
// shuffles. vpdpwssd multiplies them with q and adds pairs into int32 lanes; every int32 lane stays inside
// one block, so per 128 k (S[s], s = 0..3) 128-bit lane b holds four partial sums of block 4s + b. An
// unpack/add tree turns S[0..3] into one vector of the 16 block sums (lane 4b + s = block 4s + b); the
// zero points come off in int32 (z times the block's sum of q) and one FMA applies the 16 blocks' scales,
// gathered into the same lane order. Groups of 512 k or more (and per-channel weights) skip the tree: the
// chunk lies inside one group, so its S are summed and scaled by one broadcast scale. UINT4_MIN has no zero
// points: its codes go in as they are and each group's min times its sum of q is added in fp32 (grouped: a
// second FMA with the mins gathered like the scales; ONE: per chunk, with the chunk's sum of q).
#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

template <bool TAIL>
AVX512_VNNI inline __m512i load64(const uint8_t* p, int64_t bytes) {
  if constexpr (TAIL) return _mm512_maskz_loadu_epi8(bytes_mask(bytes), p);
  else return _mm512_loadu_si512(p);
}

// (P0, P1) -> one vector of the sums of their 128-bit lanes' pairs (the first level of the block-sum tree)
AVX512_VNNI inline __m512i fold_pair(__m512i p0, __m512i p1) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
}

// code vector v (of NV per 128 k) of weight row `row` at k, as int16 words (Q int16_t) or bytes (int8_t), in the
// order of x's vectors: x vector v is at q + k + v * 64 / sizeof(Q) (PAIRS / NIBBLES / NIBBLES8W, gemv_quant.h)
// Q int8_t (x as bytes, vpdpbusd, NIBBLES8W): 8-bit codes are regrouped per block as a grouped weight's are (also
// per channel: x's order is NIBBLES8W's), and INT8's go in with their sign bit flipped, as the unsigned bytes code +
// 128 that vpdpbusd takes (FIXED_ZERO takes the 128 off again)
template <int F, bool ONE, bool TAIL, typename Q>
struct Codes {
  static constexpr bool BYTES = std::is_same_v<Q, int8_t>;
  static constexpr int NV = BYTES ? 2 : 4;
  __m512i w0, w1;
  AVX512_VNNI void load(const uint8_t* row, int64_t k, int64_t K) {
    if constexpr (FOUR_BIT<F>) {   // 128-bit lane b: block b's 16 bytes
      w0 = load64<TAIL>(row + k / 2, (K - k) / 2);
    } else {
      w0 = load64<TAIL>(row + k, K - k), w1 = load64<TAIL>(row + k + 64, K - k - 64);
      if constexpr (!ONE || BYTES) {   // 128-bit lane b of w0 / w1 = the first / last 16 codes of block b
        const __m512i first = _mm512_shuffle_i64x2(w0, w1, 0x88);
        w1 = _mm512_shuffle_i64x2(w0, w1, 0xDD), w0 = first;
      }
      if constexpr (BYTES && F == INT8) {
        const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
        w0 = _mm512_xor_si512(w0, sign), w1 = _mm512_xor_si512(w1, sign);
      }
    }
  }
  AVX512_VNNI __m512i get(int v) const {
    if constexpr (BYTES && !FOUR_BIT<F>) {   // NIBBLES8W, 8-bit codes: each block's first, then last 16
      return v == 0 ? w0 : w1;
    } else if constexpr (BYTES) {   // NIBBLES8W: the low, then the high nibbles as bytes
      const __m512i nib = _mm512_set1_epi8(0x0F);
      return v == 0 ? _mm512_and_si512(w0, nib) : _mm512_and_si512(_mm512_srli_epi16(w0, 4), nib);
    } else if constexpr (FOUR_BIT<F>) {   // NIBBLES: nibble v of each word
      const __m512i nib = _mm512_set1_epi16(0x000F);
      return v == 3 ? _mm512_srli_epi16(w0, 12) : _mm512_and_si512(_mm512_srli_epi16(w0, 4 * v), nib);
    } else {   // PAIRS: low, high bytes of w0, then of w1; NIBBLES (grouped): low of w0, low of w1, high, high
      const __m512i w = (ONE ? v < 2 : v % 2 == 0) ? w0 : w1;
      const bool high = ONE ? v % 2 == 1 : v >= 2;
      if constexpr (F == INT8) return high ? _mm512_srai_epi16(w, 8) : _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8);
      else return high ? _mm512_srli_epi16(w, 8) : _mm512_and_si512(w, _mm512_set1_epi16(0x00FF));
    }
  }
};

// the zero point of every group of format F when its codes meet x as bytes (Q int8_t, see Codes) or as words: INT4's
// 8, INT8's 128 as bytes (code + 128); 0 for the rest (per-group zero points: zero_of)
template <int F, typename Q>
constexpr int FIXED_ZERO = F == INT4 ? 8 : F == INT8 && std::is_same_v<Q, int8_t> ? 128 : 0;

AVX512_VNNI inline __m512i dpv(__m512i acc, __m512i codes, __m512i x, int16_t) {
  return _mm512_dpwssd_epi32(acc, codes, x);
}
AVX512_VNNI inline __m512i dpv(__m512i acc, __m512i codes, __m512i x, int8_t) {   // u8 codes x s8 x
  return _mm512_dpbusd_epi32(acc, codes, x);
}

// the int32 sums of chunk [k0, k0 + 512) for R weight rows and MB rows of x, out[r * MB + m] (TAIL: k may end inside
// it, K is then the row's end; bytes beyond it are not read). ONE: the chunk's sum spread over the lanes (only its
// total matters); else the 16 block sums, lane 4b + s = block 4s + b. Per 128 k (step s), each vector of x is loaded
// once and meets the codes of all R weight rows; in step s, 128-bit lane b of a partial sum P holds four partial
// sums of block 4s + b, and each pair of steps is folded as soon as it is done (the unpack/add tree, evaluated
// early: fewer live registers). Every sum is an exact int32, so R, MB and the fold order change no bit.
// Q: int16_t (x in PAIRS / NIBBLES: vpdpwssd), or int8_t (4-bit codes, x in NIBBLES8W: vpdpbusd, a 64-byte load of
// codes is two of them, its low and its high nibbles as bytes, instead of four vpdpwssd on words).
template <int F, int R, int MB, bool ONE, bool TAIL, typename Q>
AVX512_VNNI inline void chunk_sums(const uint8_t* const* wr, const Q* const* q, int64_t k0, int64_t K,
                                   __m512i out[R * MB]) {
  using C = Codes<F, ONE, TAIL, Q>;
  // step s's products added into acc (its own accumulators: the steps of a pair are two independent chains)
  const auto step = [&](int s, __m512i* acc) AVX512_VNNI __attribute__((always_inline)) {
    const int64_t k = k0 + 128 * s;
    if (TAIL && k >= K) return;
    C codes[R];
    for (int r = 0; r < R; ++r) codes[r].load(wr[r], k, K);
#pragma GCC unroll 4
    for (int v = 0; v < C::NV; ++v) {
      __m512i c[R];
      for (int r = 0; r < R; ++r) c[r] = codes[r].get(v);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_loadu_si512(q[m] + k + v * 64 / static_cast<int64_t>(sizeof(Q)));
        for (int r = 0; r < R; ++r) acc[r * MB + m] = dpv(acc[r * MB + m], c[r], xv, Q());
      }
    }
  };
  // Two accumulators per pair of steps, written out step by step rather than indexed by the step's parity: a loop
  // the compiler leaves rolled would keep parity-indexed accumulators in memory (at 5 rows of x it did).
  __m512i A[R * MB], B[R * MB];
  for (int i = 0; i < R * MB; ++i) A[i] = B[i] = _mm512_setzero_si512();
  step(0, A);
  step(1, B);
  if constexpr (ONE) {
    step(2, A);
    step(3, B);
    for (int i = 0; i < R * MB; ++i) out[i] = _mm512_add_epi32(A[i], B[i]);
    return;
  }
  __m512i T[R * MB];   // steps 0 and 1, folded
  for (int i = 0; i < R * MB; ++i) T[i] = fold_pair(A[i], B[i]), A[i] = B[i] = _mm512_setzero_si512();
  step(2, A);
  step(3, B);
  for (int i = 0; i < R * MB; ++i) {
    const __m512i f = fold_pair(A[i], B[i]);
    out[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(T[i], f), _mm512_unpackhi_epi64(T[i], f));
  }
}

// the sums of the 16 lanes of up to four vectors, each added up in _mm512_reduce_add_ps's order (lane i + lane i + 8,
// then i + 4, i + 2, i + 1: the same bits), the four reductions sharing their shuffles and adds
AVX512_VNNI inline void lane_sums(const __m512* v, int count, float* out) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 a = v[0], b = count > 1 ? v[1] : zero, c = count > 2 ? v[2] : zero, d = count > 3 ? v[3] : zero;
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));   // lane 4j: vector j's sum
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int j = 0; j < count; ++j) out[j] = lanes[4 * j];
}

// what the AVX-512 rows share, worked out once per call (no divisions per chunk)
struct Chunking {
  __m512i gidx;          // grouped: lane 4b + s's group, counted from the chunk's first one: (4s + b) / (G / 32)
  int64_t per_chunk;     // grouped: groups per chunk (512 / G)
  int64_t chunks_per_group;   // ONE: chunks of 512 k per group (per channel: all of them)
};

// weight rows n[0..R) against MB rows of x from m0 (x in the PAIRS / NIBBLES layout, Q int16_t, or NIBBLES8W, int8_t)
template <int F, int R, int MB, bool ONE, typename Q>
AVX512_VNNI void row_avx512(const Act16& a, int64_t m0, const QuantView& w, int64_t K, const int64_t* n, float* y,
                            int64_t N, const Chunking& ch) {
  const uint8_t* wr[R];
  const at::Half* sr[R];
  const uint8_t* zr[R];
  const at::Half* mr[R];
  for (int r = 0; r < R; ++r) {
    wr[r] = w.codes + n[r] * w.row_bytes, sr[r] = w.scales + n[r] * w.groups;
    zr[r] = w.zeros ? w.zeros + n[r] * w.groups : nullptr;
    mr[r] = w.mins ? w.mins + n[r] * w.groups : nullptr;
  }
  const int64_t nb = a.padded / BLOCK, chunks = nb / 16, full = K / CHUNK;
  const Q* q[MB];
  __m512 total[R * MB];
  float zsum[R * MB];   // ONE: sum over chunks of s * z * (sum of q over the chunk) (UINT4_MIN: of -m * that sum)
  for (int m = 0; m < MB; ++m) {
    if constexpr (std::is_same_v<Q, int8_t>) q[m] = a.q8.data() + (m0 + m) * a.padded;
    else q[m] = a.q.data() + (m0 + m) * a.padded;
  }
  for (int i = 0; i < R * MB; ++i) total[i] = _mm512_setzero_ps(), zsum[i] = 0.f;
  int64_t g = 0, in_group = 0;   // ONE: the chunk's group, and its place in it
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * CHUNK;
    __m512i S[R * MB];
    if (c < full) chunk_sums<F, R, MB, ONE, false, Q>(wr, q, k0, K, S);
    else chunk_sums<F, R, MB, ONE, true, Q>(wr, q, k0, K, S);
    for (int r = 0; r < R; ++r) {
      if constexpr (ONE) {
        const float s = _cvtsh_ss(sr[r][g].x);
        const __m512 sv = _mm512_set1_ps(s);
        for (int m = 0; m < MB; ++m) {
          total[r * MB + m] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(S[r * MB + m]), total[r * MB + m]);
          if constexpr (HAS_MIN<F>)
            zsum[r * MB + m] -= min_of<F>(mr[r], g) * static_cast<float>(a.chunk_sum[(m0 + m) * chunks + c]);
          else if constexpr (F != INT8 || FIXED_ZERO<F, Q> != 0)
            zsum[r * MB + m] += s * static_cast<float>((FIXED_ZERO<F, Q> ? FIXED_ZERO<F, Q> : zero_of<F>(zr[r], g)) *
                                                       a.chunk_sum[(m0 + m) * chunks + c]);
        }
      } else {
        const int64_t g0 = c * ch.per_chunk, count = std::min(ch.per_chunk, w.groups - g0);   // the chunk's groups
        const __mmask16 gm = static_cast<__mmask16>((1u << count) - 1);
        const __m512 sv = _mm512_permutexvar_ps(ch.gidx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, sr[r] + g0)));
        __m512i zv = _mm512_setzero_si512();
        if constexpr (F == UINT8 || F == UINT4)
          zv = _mm512_permutexvar_epi32(ch.gidx, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, zr[r] + g0)));
        __m512 mv = _mm512_setzero_ps();   // UINT4_MIN: each block's group's min, lanes as sv's
        if constexpr (HAS_MIN<F>)
          mv = _mm512_permutexvar_ps(ch.gidx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, mr[r] + g0)));
        for (int m = 0; m < MB; ++m) {
          __m512i sums = S[r * MB + m];
          const __m512i bq = _mm512_loadu_si512(a.block_sum.data() + (m0 + m) * nb + 16 * c);
          if constexpr (HAS_MIN<F>)   // a block's share of its group's min term: m * (its sum of q)
            total[r * MB + m] = _mm512_fmadd_ps(mv, _mm512_cvtepi32_ps(bq), total[r * MB + m]);
          else if constexpr (FIXED_ZERO<F, Q> != 0)   // 8 or 128: a shift
            sums = _mm512_sub_epi32(sums, _mm512_slli_epi32(bq, __builtin_ctz(FIXED_ZERO<F, Q>)));
          else if constexpr (F != INT8)
            sums = _mm512_sub_epi32(sums, _mm512_mullo_epi32(zv, bq));
          total[r * MB + m] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(sums), total[r * MB + m]);
        }
      }
    }
    if (ONE && ++in_group == ch.chunks_per_group) in_group = 0, ++g;
  }
  float sums[R * MB];
  for (int i = 0; i < R * MB; i += 4) lane_sums(total + i, std::min(4, R * MB - i), sums + i);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      y[(m0 + m) * N + n[r]] = a.d[m0 + m] * (sums[r * MB + m] - zsum[r * MB + m]);
}


template <int F, bool ONE, typename Q>
AVX512_VNNI void rows_avx512_mode(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1,
                                  float* y, int64_t N) {
  Chunking ch;
  alignas(64) int32_t idx[16];
  for (int lane = 0; lane < 16; ++lane) idx[lane] = ONE ? 0 : (4 * (lane % 4) + lane / 4) / (w.group / BLOCK);
  ch.gidx = _mm512_load_si512(idx);
  ch.per_chunk = ONE ? 0 : CHUNK / w.group;
  ch.chunks_per_group = w.groups == 1 ? a.padded / CHUNK : w.group / CHUNK;
  // two streams per thread, as gemv.cpp's rows_m1_avx512: rows i and part + i of its block (batch-invariant mode:
  // tiled_rows' order for every row count)
  if (M == 1 && !batch_invariant()) {
    const int64_t part = (n1 - n0) / 2;
    for (int64_t i = 0; i < part; ++i) {
      const int64_t n[2] = {n0 + i, n0 + part + i};
      row_avx512<F, 2, 1, ONE, Q>(a, 0, w, K, n, y, N, ch);
    }
    if ((n1 - n0) % 2) {
      const int64_t last = n1 - 1;
      row_avx512<F, 1, 1, ONE, Q>(a, 0, w, K, &last, y, N, ch);
    }
    return;
  }
  // more rows of x: a tile of weight rows at a time (gemv_quant.h: tiled_rows), one weight row against MR rows of x;
  // up to MR_ONE_PASS rows in one pass (a speculative verify step's 5: a second pass would load and unpack every
  // code again for the fifth row alone)
  const auto row = [&](int64_t m, int64_t mb, int64_t n) {
    switch (mb) {
      case 1: row_avx512<F, 1, 1, ONE, Q>(a, m, w, K, &n, y, N, ch); break;
      case 2: row_avx512<F, 1, 2, ONE, Q>(a, m, w, K, &n, y, N, ch); break;
      case 3: row_avx512<F, 1, 3, ONE, Q>(a, m, w, K, &n, y, N, ch); break;
      case 4: row_avx512<F, 1, 4, ONE, Q>(a, m, w, K, &n, y, N, ch); break;
      default: row_avx512<F, 1, 5, ONE, Q>(a, m, w, K, &n, y, N, ch); break;
    }
  };
  if (M <= MR_ONE_PASS) tiled_rows<MR_ONE_PASS>(w, M, n0, n1, row);
  else tiled_rows(w, M, n0, n1, row);
}

template <int F, typename Q>
bool rows_avx512_of(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                    int64_t N, const FinishBlock* finish) {
  // int8 x, many rows, groups below a chunk; batch-invariant mode too: the lanes kernel's bits are this one's
  // (tests/kernels/test_quant_prompt_rows.py)
  if constexpr (std::is_same_v<Q, int8_t> && F != UINT8)
    if (M >= LANES_MIN_ROWS && w.groups > 1 && w.group % CHUNK != 0) {
      rows_lanes<F>(a, M, w, K, n0, n1, y, N, finish);
      return finish != nullptr;
    }
  if (w.groups == 1 || w.group % CHUNK == 0) rows_avx512_mode<F, true, Q>(a, M, w, K, n0, n1, y, N);
  else rows_avx512_mode<F, false, Q>(a, M, w, K, n0, n1, y, N);
  return false;
}

}  // namespace

template <int F>
bool rows_avx512(const Act16& a, int64_t M, const QuantView& w, int64_t K, int64_t n0, int64_t n1, float* y,
                 int64_t N, Layout layout, const FinishBlock* finish) {
  if (layout == NIBBLES8W) return rows_avx512_of<F, int8_t>(a, M, w, K, n0, n1, y, N, finish);
  return rows_avx512_of<F, int16_t>(a, M, w, K, n0, n1, y, N, finish);
}

#define ROWS_AVX512(F)                                                                                         \
  template bool rows_avx512<F>(const Act16&, int64_t, const QuantView&, int64_t, int64_t, int64_t, float*, int64_t, \
                               Layout, const FinishBlock*);
ROWS_AVX512(INT8)
ROWS_AVX512(UINT8)
ROWS_AVX512(INT4)
ROWS_AVX512(UINT4)
ROWS_AVX512(UINT4_MIN)

}  // namespace qgemv
