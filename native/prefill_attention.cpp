// Causal attention of a prompt chunk over its context in the span KV cache (the multi-token rows of a prefill
// step), with AVX-512 (Wide) or AVX2 (Narrow); what ops.prefill_attention takes instead of ATen's
// scaled_dot_product_attention where it can.
//
//   q        [T, H, D]       fp32 or bf16 (the activation dtype); D = 16 DV, DV of prefill_attention_supports
//   k_cache  [S, P, KVH, D]  same dtype as q
//   v_cache  [S, P, KVH, D]
//   slots    [ctx] int64     the cache slot (span * P + offset) of each context position, the chunk's own last
//   out      [T, H, D]       same dtype as q, written
//
// Query row i sits at position ctx - T + i and attends keys 0 .. ctx - T + i (a chunk after a cached prefix or an
// earlier chunk included). A task is one KV head g and a block of QB query positions: its G * QB rows (the G query
// heads that share g) meet each block of KB keys once. The block's keys and values are copied into fp32 scratch;
// scores come 4 rows x 4 keys at a time as dot products along D (16 vector accumulators, summed across lanes by
// simd::sums16); each row keeps a running max and sum (online softmax: its accumulator is rescaled when the max
// grows); the weights meet the values 24 / DV rows at a time (AVX2: scores 2 rows x 4 keys, values 2 rows x 32 of
// D). Everything runs in fp32 and the output is rounded once into the activation dtype. Tasks cost what their keys
// cost, so they are dealt to the threads from both ends of the chunk at once (early and late query blocks
// alternate), which splits a causal chunk's work evenly.
// A row's result depends on its own query and keys only, and its sums run in the same order whatever the chunk's
// other rows are, but not in a decode step's order: batch-invariant mode keeps the decode kernel for prompt rows.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

#define PA_ISA __attribute__((target("avx512f,avx512bw,avx512vl")))
#define PA_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t KB = 32;        // keys per block (two vectors of scores per row)
constexpr int64_t ROW_PAD = 12;   // rows are padded to a multiple of this (the 4-row score steps, the PV row groups)
constexpr int64_t TARGET_ROWS = 48;   // rows a task gives each key block (G x QB)

// A thread's buffers, in one allocation: each starts at its own offset within a 4 KiB page (STAGGER floats apart), so
// the loads of one and the stores of another never alias in the low 12 address bits (a separately allocated set
// did, depending on the heap's history, and then ran ~25% slower)
struct Scratch {
  std::vector<float> arena;
  float *q, *o, *s, *k, *v, *m, *l, *alpha;
  std::vector<int64_t> pos;

  void size(int64_t rows, int64_t D) {
    constexpr int64_t PAGE = 1024, STAGGER = 80;   // floats
    const int64_t sizes[8] = {rows * D, rows * D, rows * KB, KB * D, KB * D, rows, rows, rows};
    float** at[8] = {&q, &o, &s, &k, &v, &m, &l, &alpha};
    int64_t offsets[8], end = 0;
    for (int i = 0; i < 8; ++i) {
      offsets[i] = (end + PAGE - 1) / PAGE * PAGE + i * STAGGER;
      end = offsets[i] + sizes[i];
    }
    if (static_cast<int64_t>(arena.size()) < end + 16) arena.resize(end + 16);
    float* base = arena.data();
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64 / sizeof(float);   // 64-byte aligned
    for (int i = 0; i < 8; ++i) *at[i] = base + offsets[i];
    pos.resize(rows);
  }
};

// AVX-512: 16 lanes
struct Wide {
// a row of D values (T) as fp32, and an fp32 row times inv rounded into T
template <typename T>
PA_ISA static void load_row(const T* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, simd::load16(src + d));
}
template <typename T>
PA_ISA static void store_row(const float* src, float inv, int64_t D, T* dst) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) simd::store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), vinv));
}

// scores s[r][j] = scale * q_r . k_j for rows [0, rows) (a multiple of 4) and the block's KB keys
template <int DV>
PA_ISA static void scores(const float* q, const float* ks, int64_t rows, float scale, float* s) {
  constexpr int64_t D = 16 * DV;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    for (int64_t j0 = 0; j0 < KB; j0 += 4) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int dv = 0; dv < DV; ++dv) {
        __m512 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(ks + (j0 + j) * D + 16 * dv);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m512 qv = _mm512_loadu_ps(q + (r0 + r) * D + 16 * dv);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) acc[4 * r + j] = _mm512_fmadd_ps(qv, kv[j], acc[4 * r + j]);
        }
      }
      // lane 4r + j: row r0 + r's score of key j0 + j
      alignas(64) float out[16];
      _mm512_store_ps(out, _mm512_mul_ps(simd::sums16(acc), vscale));
      for (int r = 0; r < 4; ++r)
        for (int j = 0; j < 4; ++j) s[(r0 + r) * KB + j0 + j] = out[4 * r + j];
    }
  }
}

// each row's scores -> its weights exp(s - max) in place (keys past the row's position: 0), with the running max,
// sum and the factor alpha its accumulator is rescaled by
PA_ISA static void online_softmax(float* s, int64_t rows, const int64_t* pos, int64_t t0, float* m, float* l,
                                  float* alpha) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * KB;
    const __m512i last = _mm512_set1_epi32(static_cast<int>(pos[r] - t0));   // keys t0 + j with j <= last attend
    const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, last);
    const __mmask16 v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), last);
    const __m512 s0 = _mm512_mask_blend_ps(v0, minus_inf, _mm512_loadu_ps(sr));
    const __m512 s1 = _mm512_mask_blend_ps(v1, minus_inf, _mm512_loadu_ps(sr + 16));
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float m_new = std::max(m[r], mx);   // finite: every row's first block holds key 0
    alpha[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, simd::exp_nonpositive(_mm512_sub_ps(s0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, simd::exp_nonpositive(_mm512_sub_ps(s1, mv)));
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    m[r] = m_new;
    _mm512_storeu_ps(sr, p0);
    _mm512_storeu_ps(sr + 16, p1);
  }
}

// o[r] = alpha[r] * o[r] + sum_j p[r][j] v_j, PR rows at a time (PR * DV accumulators)
template <int DV>
PA_ISA static void weighted_values(const float* p, const float* vs, const float* alpha, int64_t rows, float* o) {
  constexpr int64_t D = 16 * DV;
  constexpr int PR = DV >= 24 ? 1 : (24 / DV > ROW_PAD ? ROW_PAD : 24 / DV);
  for (int64_t r0 = 0; r0 < rows; r0 += PR) {
    __m512 acc[PR * DV];
#pragma GCC unroll 12
    for (int r = 0; r < PR; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
#pragma GCC unroll 16
      for (int dv = 0; dv < DV; ++dv) acc[r * DV + dv] = _mm512_mul_ps(a, _mm512_loadu_ps(o + (r0 + r) * D + 16 * dv));
    }
    for (int64_t j = 0; j < KB; ++j) {
#pragma GCC unroll 16
      for (int dv = 0; dv < DV; ++dv) {
        const __m512 vv = _mm512_loadu_ps(vs + j * D + 16 * dv);
#pragma GCC unroll 12
        for (int r = 0; r < PR; ++r)
          acc[r * DV + dv] = _mm512_fmadd_ps(_mm512_set1_ps(p[(r0 + r) * KB + j]), vv, acc[r * DV + dv]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < PR; ++r)
#pragma GCC unroll 16
      for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(o + (r0 + r) * D + 16 * dv, acc[r * DV + dv]);
  }
}
};

// AVX2: 8 lanes, 16 registers. Scores 2 rows x 4 keys at a time (the 8 sums across lanes by hadds), the weights
// meeting the values 2 rows x 4 vectors (32 of D) at a time
struct Narrow {
template <typename T>
PA_AVX2 static void load_row(const T* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, simd::load8(src + d));
}
template <typename T>
PA_AVX2 static void store_row(const float* src, float inv, int64_t D, T* dst) {
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 8) simd::store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vinv));
}

// lane i: the sum of v[i]'s lanes
PA_AVX2 static inline __m256 sums8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int DV>
PA_AVX2 static void scores(const float* q, const float* ks, int64_t rows, float scale, float* s) {
  constexpr int64_t D = 16 * DV;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 2) {
    for (int64_t j0 = 0; j0 < KB; j0 += 4) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int dv = 0; dv < 2 * DV; ++dv) {
        __m256 kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = _mm256_loadu_ps(ks + (j0 + j) * D + 8 * dv);
        for (int r = 0; r < 2; ++r) {
          const __m256 qv = _mm256_loadu_ps(q + (r0 + r) * D + 8 * dv);
          for (int j = 0; j < 4; ++j) acc[4 * r + j] = _mm256_fmadd_ps(qv, kv[j], acc[4 * r + j]);
        }
      }
      alignas(32) float out[8];   // lane 4r + j: row r0 + r's score of key j0 + j
      _mm256_store_ps(out, _mm256_mul_ps(sums8(acc), vscale));
      for (int r = 0; r < 2; ++r)
        for (int j = 0; j < 4; ++j) s[(r0 + r) * KB + j0 + j] = out[4 * r + j];
    }
  }
}

PA_AVX2 static void online_softmax(float* s, int64_t rows, const int64_t* pos, int64_t t0, float* m, float* l,
                                   float* alpha) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * KB;
    const __m256i last = _mm256_set1_epi32(static_cast<int>(pos[r] - t0));   // keys t0 + j with j <= last attend
    __m256 sv[4], valid[4];
    __m256 mx = minus_inf;
    for (int i = 0; i < 4; ++i) {
      const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i));
      valid[i] = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(key, last), _mm256_set1_epi32(-1)));
      sv[i] = _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(sr + 8 * i), valid[i]);
      mx = _mm256_max_ps(mx, sv[i]);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    const float m_new = std::max(m[r], *std::max_element(lanes, lanes + 8));
    alpha[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - m_new);
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_and_ps(valid[i], simd::exp_nonpositive8(_mm256_sub_ps(sv[i], mv)));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(sr + 8 * i, p);
    }
    l[r] = l[r] * alpha[r] + simd::hsum8(sum);
    m[r] = m_new;
  }
}

template <int DV>
PA_AVX2 static void weighted_values(const float* p, const float* vs, const float* alpha, int64_t rows, float* o) {
  constexpr int64_t D = 16 * DV;
  constexpr int NV = 2 * DV % 4 == 0 ? 4 : 2;   // vectors of D a pass (D = 16 DV: 2 always divides 2 DV)
  for (int64_t d0 = 0; d0 < D; d0 += 8 * NV) {
    for (int64_t r0 = 0; r0 < rows; r0 += 2) {
      __m256 acc[2 * NV];
      for (int r = 0; r < 2; ++r) {
        const __m256 a = _mm256_set1_ps(alpha[r0 + r]);
        for (int v = 0; v < NV; ++v)
          acc[r * NV + v] = _mm256_mul_ps(a, _mm256_loadu_ps(o + (r0 + r) * D + d0 + 8 * v));
      }
      for (int64_t j = 0; j < KB; ++j) {
        __m256 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = _mm256_loadu_ps(vs + j * D + d0 + 8 * v);
        for (int r = 0; r < 2; ++r) {
          const __m256 pr = _mm256_set1_ps(p[(r0 + r) * KB + j]);
          for (int v = 0; v < NV; ++v) acc[r * NV + v] = _mm256_fmadd_ps(pr, vv[v], acc[r * NV + v]);
        }
      }
      for (int r = 0; r < 2; ++r)
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + (r0 + r) * D + d0 + 8 * v, acc[r * NV + v]);
    }
  }
}
};

// one key block's K and V rows [KB, D] in fp32; rows past `n` zeroed (their weights are 0, and 0 * garbage may be NaN)
template <typename K, typename T>
void pack_keys(const T* k_cache, const T* v_cache, const int64_t* slots, int64_t t0, int64_t n, int64_t KVH, int64_t g,
               int64_t D, float* ks, float* vs) {
  for (int64_t j = 0; j < KB; ++j) {
    if (j >= n) {
      std::fill(ks + j * D, ks + (j + 1) * D, 0.f);
      std::fill(vs + j * D, vs + (j + 1) * D, 0.f);
      continue;
    }
    const int64_t row = (slots[t0 + j] * KVH + g) * D;
    K::load_row(k_cache + row, D, ks + j * D);
    K::load_row(v_cache + row, D, vs + j * D);
  }
}

template <typename T, int DV, typename K>
void run_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, T* out, int64_t T_rows, int64_t H,
              int64_t KVH, int64_t ctx, int64_t g, int64_t q0, int64_t qb, float scale, Scratch& w) {
  constexpr int64_t D = 16 * DV;
  const int64_t G = H / KVH, n_pos = std::min(qb, T_rows - q0), rows = G * n_pos;
  const int64_t padded = (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  w.size(padded, D);
  std::fill(w.o, w.o + padded * D, 0.f);
  std::fill(w.m, w.m + padded, -std::numeric_limits<float>::infinity());
  std::fill(w.l, w.l + padded, 0.f);
  for (int64_t r = 0; r < padded; ++r) {   // row i * G + h: position q0 + i, head g * G + h; padding repeats row 0
    const int64_t src = r < rows ? r : 0, i = src / G, h = src % G;
    K::load_row(q + ((q0 + i) * H + g * G + h) * D, D, w.q + r * D);
    w.pos[r] = ctx - T_rows + q0 + i;
  }
  const int64_t kend = ctx - T_rows + q0 + n_pos;   // the block's last position + 1
  for (int64_t t0 = 0; t0 < kend; t0 += KB) {
    pack_keys<K>(k_cache, v_cache, slots, t0, std::min(KB, kend - t0), KVH, g, D, w.k, w.v);
    K::template scores<DV>(w.q, w.k, padded, scale, w.s);
    K::online_softmax(w.s, padded, w.pos.data(), t0, w.m, w.l, w.alpha);
    K::template weighted_values<DV>(w.s, w.v, w.alpha, padded, w.o);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, h = r % G;
    K::store_row(w.o + r * D, 1.f / w.l[r], D, out + ((q0 + i) * H + g * G + h) * D);
  }
}

template <typename T, int DV, typename K>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& slots, torch::Tensor& out, float scale) {
  const int64_t T_rows = q.size(0), H = q.size(1), KVH = k_cache.size(2), ctx = slots.size(0), G = H / KVH;
  const int64_t qb = std::max<int64_t>(1, TARGET_ROWS / G), blocks = (T_rows + qb - 1) / qb;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // task k: query block order[k / KVH] (0, last, 1, last - 1, ...: any run of tasks mixes cheap and dear ones)
  allspark::parallel_for(0, blocks * KVH, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch w;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t slot = k / KVH, g = k % KVH;
      const int64_t b = slot % 2 == 0 ? slot / 2 : blocks - 1 - slot / 2;
      run_task<T, DV, K>(qp, kp, vp, sp, op, T_rows, H, KVH, ctx, g, b * qb, qb, scale, w);
    }
  });
}

template <typename T, typename K>
void run_dv(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& slots, torch::Tensor& out, float scale) {
  switch (q.size(2) / 16) {
    case 1: return run<T, 1, K>(q, k_cache, v_cache, slots, out, scale);
    case 2: return run<T, 2, K>(q, k_cache, v_cache, slots, out, scale);
    case 4: return run<T, 4, K>(q, k_cache, v_cache, slots, out, scale);
    case 5: return run<T, 5, K>(q, k_cache, v_cache, slots, out, scale);
    case 6: return run<T, 6, K>(q, k_cache, v_cache, slots, out, scale);
    case 8: return run<T, 8, K>(q, k_cache, v_cache, slots, out, scale);
    case 16: return run<T, 16, K>(q, k_cache, v_cache, slots, out, scale);
    default: TORCH_CHECK(false, "prefill_attention: head dim ", q.size(2), " is not supported");
  }
}

}  // namespace

bool prefill_attention_supports(int64_t head_dim) {
  if (head_dim % 16 != 0) return false;
  const int64_t dv = head_dim / 16;
  return dv == 1 || dv == 2 || dv == 4 || dv == 5 || dv == 6 || dv == 8 || dv == 16;
}

void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                       torch::Tensor out, double scale, int64_t isa) {
  TORCH_CHECK(isa >= 1, "prefill_attention: AVX2 (ISA level 1) or AVX-512 (2+) kernels only, not level ", isa);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "prefill_attention: q, caches and out differ in dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "prefill_attention: heads");
  TORCH_CHECK(prefill_attention_supports(q.size(2)), "prefill_attention: head dim ", q.size(2), " is not supported");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) >= q.size(0),
              "prefill_attention: slots must be int64 [ctx] with ctx >= the chunk's rows");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "prefill_attention: contiguous q, out and caches");
  TORCH_CHECK(scale > 0, "prefill_attention: scale must be > 0");
  auto sc = slots.contiguous();
  if (q.size(0) == 0) return;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat)
    isa >= 2 ? run_dv<float, Wide>(q, k_cache, v_cache, sc, out, s)
             : run_dv<float, Narrow>(q, k_cache, v_cache, sc, out, s);
  else if (q.scalar_type() == at::kBFloat16)
    isa >= 2 ? run_dv<at::BFloat16, Wide>(q, k_cache, v_cache, sc, out, s)
             : run_dv<at::BFloat16, Narrow>(q, k_cache, v_cache, sc, out, s);
  else
    TORCH_CHECK(false, "prefill_attention: fp32 or bf16 only");
}
