// Small-M linear for decode: y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 or bf16, fp32 accumulation,
// rounded once into the activation dtype (bias included), as a GEMM library does.
//
// Layout: W is row-major [N, K] (HF's [out, in]); x is [M, K] (converted to fp32 once, in the call).
// Decode is memory-bound: every weight byte is read once per step, so the kernel streams W row by
// row across torch's intra-op threads, each thread owning a contiguous block of rows (one sequential
// stream per thread). M is processed in chunks of up to 6 rows of x sharing each weight load, each row summed
// in one order at any M (so a row of a batch equals the row alone).
// ISA is chosen at run time by the caller (compute/ops.py, from py-cpuinfo): 2 = AVX-512, 1 = AVX2+FMA,
// 0 = portable C++. Tested against torch's matmul in tests/kernels/test_native.py (odd K/N, M = 1..64).
#include <torch/extension.h>
#include <immintrin.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {
std::atomic<bool> invariant_rows{false};
}  // namespace

void set_batch_invariant(bool on) { invariant_rows.store(on); }
bool batch_invariant() { return invariant_rows.load(std::memory_order_relaxed); }

namespace {

constexpr int NR = 2;         // weight rows per block when x has several rows

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename W>
inline float load_scalar(const W* p) {
  if constexpr (std::is_same_v<W, float>) return *p; else return bf16_to_float(*p);
}

// ---- portable ---------------------------------------------------------------------------------
template <typename W>
void rows_scalar(const float* x, int64_t m_rows, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                 int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * load_scalar(wr + k);
      y[m * N + n] = acc;
    }
  }
}

// ---- AVX-512 ----------------------------------------------------------------------------------
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 load16_512(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 load16_512(const uint16_t* p, __mmask16 mask) {
  __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row of x (batch-1 decode): each thread reads S weight rows at once, taken from S equal parts of
// its block of rows (S sequential streams far apart), two accumulator chains per row, one cache line of
// bf16 (half a line of fp32) per stream and step: on Zen 4 a few streams far apart keep more of the memory's
// bandwidth busy than one stream with four chains (interleaving *adjacent* rows is one stream, not several).
// The loop is bound by the bandwidth, not by instructions, so what would cut instructions (AVX512-BF16 dot
// products), more streams, rows taken dynamically and a software prefetch were tried and not kept
// (docs/performance.md, "Choices in the code").
template <typename W, int S>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void rows_m1_avx512(const float* x, int64_t K, const W* w, int64_t n0, int64_t n1, float* y) {
  const int64_t part = (n1 - n0) / S;
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t i = 0; i < part; ++i) {
    const W* wr[S];
    __m512 acc[S][2];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      wr[s] = w + (n0 + s * part + i) * K;
      acc[s][0] = acc[s][1] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k < K32; k += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        acc[s][0] = _mm512_fmadd_ps(x0, load16_512(wr[s] + k, (__mmask16)0xFFFF), acc[s][0]);
        acc[s][1] = _mm512_fmadd_ps(x1, load16_512(wr[s] + k + 16, (__mmask16)0xFFFF), acc[s][1]);
      }
    }
    for (; k < K; k += 16) {   // a whole 16-block left over, then a masked tail
      const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + k);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) acc[s][0] = _mm512_fmadd_ps(xv, load16_512(wr[s] + k, mask), acc[s][0]);
    }
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) y[n0 + s * part + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[s][0], acc[s][1]));
  }
  if constexpr (S > 1) rows_m1_avx512<W, 1>(x, K, w, n0 + S * part, n1, y);   // the rows S does not divide
}

// Several rows of x: each weight load feeds MB FMAs, so the loop is no longer purely a stream; two
// weight rows per block share the loads of x, which was the faster choice here (docs/performance.md).
// Each (row of x, weight row) sums as rows_m1_avx512 does: two chains over alternate 16-blocks of each 32, the blocks
// past the last whole 32 into the first, then the chains added and reduced. So a row comes out the same whatever
// rows share its step: a speculative verify step's rows (MR_AVX512 in one block) equal one-row steps bit for bit.
// The block's weight rows are n, n + gap, ...: rows_avx512 takes them from NB parts of its rows far apart (gap: a
// part), NB sequential streams as rows_m1_avx512 reads them. Adjacent rows (gap 1, the next block prefetched) read
// as one stream, which the Zen 4 VM streams far slower at 2 to 6 rows of x (docs/performance.md, "bf16 GEMV").
template <typename W, int MB, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void block_avx512(const float* x, int64_t K, const W* w, int64_t n, float* y, int64_t N, int64_t n_end,
                  int64_t gap = 1) {
  __m512 acc[MB][NB][2];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  const W* wr[NB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) wr[j] = w + (n + j * gap) * K;
  const bool prefetch_next = gap == 1 && n + NB + NB <= n_end;   // adjacent rows: the next block is ours too
  const int64_t K32 = K & ~int64_t(31);
  int64_t k = 0;
  for (; k < K32; k += 32) {
    if (prefetch_next) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + NB * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      __m512 wv[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) wv[j] = load16_512(wr[j] + k + 16 * c, (__mmask16)0xFFFF);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * K + k + 16 * c);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j][c] = _mm512_fmadd_ps(xv, wv[j], acc[i][j][c]);
      }
    }
  }
  for (; k < K; k += 16) {   // a whole 16-block left over, then a masked tail
    const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = load16_512(wr[j] + k, mask);
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j][0] = _mm512_fmadd_ps(xv, wv[j], acc[i][j][0]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      y[i * N + n + j * gap] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][j][0], acc[i][j][1]));
    }
}

// Up to MR_AVX512 rows of x share each weight load: a speculative verify step's k + 1 = 5 rows take the weight once
// (2 weight rows x 6 rows x 2 chains: 24 accumulators of the 32 registers)
constexpr int64_t MR_AVX512 = 6;

template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void rows_avx512(const float* x, int64_t m_rows, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                 int64_t N) {
  for (int64_t m = 0; m < m_rows; m += MR_AVX512) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    const int64_t mb = std::min(MR_AVX512, m_rows - m);
    if (mb == 1) {   // two weight rows a step from streams far apart (the same sums as block_avx512's)
      rows_m1_avx512<W, 2>(xm, K, w, n0, n1, ym);
      continue;
    }
    const int64_t part = (n1 - n0) / NR;   // NR streams far apart: rows n0 + i, n0 + part + i, ...
    for (int64_t i = 0; i < part; ++i) {
      const int64_t n = n0 + i;
      switch (mb) {
        case 2: block_avx512<W, 2, NR>(xm, K, w, n, ym, N, n1, part); break;
        case 3: block_avx512<W, 3, NR>(xm, K, w, n, ym, N, n1, part); break;
        case 4: block_avx512<W, 4, NR>(xm, K, w, n, ym, N, n1, part); break;
        case 5: block_avx512<W, 5, NR>(xm, K, w, n, ym, N, n1, part); break;
        default: block_avx512<W, 6, NR>(xm, K, w, n, ym, N, n1, part); break;
      }
    }
    for (int64_t n = n0 + NR * part; n < n1; ++n) {   // the rows NR does not divide
      switch (mb) {
        case 2: block_avx512<W, 2, 1>(xm, K, w, n, ym, N, n1); break;
        case 3: block_avx512<W, 3, 1>(xm, K, w, n, ym, N, n1); break;
        case 4: block_avx512<W, 4, 1>(xm, K, w, n, ym, N, n1); break;
        case 5: block_avx512<W, 5, 1>(xm, K, w, n, ym, N, n1); break;
        default: block_avx512<W, 6, 1>(xm, K, w, n, ym, N, n1); break;
      }
    }
  }
}

// ---- AVX2 -------------------------------------------------------------------------------------
// Each weight row is prefetched 2 KiB ahead (simd.h): the Zen 3-class AVX2 VM's hardware prefetchers fall behind a
// thread's stream (docs/performance.md, "Choices in the code").
template <typename W, int MB>
__attribute__((target("avx2,fma")))
void row_avx2(const float* x, int64_t K, const W* wr, float* y, int64_t N) {
  constexpr int U = 2;
  __m256 acc[MB][U];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm256_setzero_ps();
  const int64_t KU = K - K % (8 * U);
  for (int64_t k = 0; k < KU; k += 8 * U) {
    if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0) simd::prefetch_stream(wr + k);   // simd.h: why
    for (int u = 0; u < U; ++u) {
      const __m256 wv = simd::load8(wr + k + 8 * u);
      for (int i = 0; i < MB; ++i) acc[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8 * u), wv, acc[i][u]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float s = simd::hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
    for (int64_t k = KU; k < K; ++k) s += x[i * K + k] * load_scalar(wr + k);
    y[i * N] = s;
  }
}

// Up to MR_AVX2 rows of x share each weight vector (its load and, for bf16, its widening: what bounds this kernel
// with several rows), so a speculative verify step's 5 rows are one block (2 x 6 accumulators, 2 weight vectors: 14
// of the 16 registers); more rows take more blocks, each weight row meeting all of them while it is in L1. A row of
// x is summed the same way in any block and at any row count.
constexpr int64_t MR_AVX2 = 6;

template <typename W>
__attribute__((target("avx2,fma")))
void rows_avx2(const float* x, int64_t m_rows, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
               int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    for (int64_t m = 0; m < m_rows; m += MR_AVX2) {
      const float* xm = x + m * K;
      float* ym = y + m * N;
      switch (std::min(MR_AVX2, m_rows - m)) {
        case 1: row_avx2<W, 1>(xm, K, wr, ym + n, N); break;
        case 2: row_avx2<W, 2>(xm, K, wr, ym + n, N); break;
        case 3: row_avx2<W, 3>(xm, K, wr, ym + n, N); break;
        case 4: row_avx2<W, 4>(xm, K, wr, ym + n, N); break;
        case 5: row_avx2<W, 5>(xm, K, wr, ym + n, N); break;
        default: row_avx2<W, 6>(xm, K, wr, ym + n, N); break;
      }
    }
  }
}

template <typename W> struct Act { using type = float; };                  // the activation type of W
template <> struct Act<uint16_t> { using type = at::BFloat16; };

// y = x . W^T (+ bias), rounded once into the activation dtype; each task converts its own columns.
template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const W* bias, typename Act<W>::type* out,
         int64_t isa) {
  using O = typename Act<W>::type;
  // grain: at least ~64 KiB of weights per task
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W));
  const int64_t grain = allspark::weight_rows_grain(row_bytes);
  std::vector<float> scratch(std::is_same_v<O, float> ? 0 : M * N);
  float* y = std::is_same_v<O, float> ? reinterpret_cast<float*>(out) : scratch.data();
  allspark::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (isa >= 2) rows_avx512<W>(x, M, K, w, n0, n1, y, N);
    else if (isa == 1) rows_avx2<W>(x, M, K, w, n0, n1, y, N);
    else rows_scalar<W>(x, M, K, w, n0, n1, y, N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        const float v = y[m * N + n] + (bias ? load_scalar(bias + n) : 0.f);
        out[m * N + n] = static_cast<O>(v);
      }
  });
}

}  // namespace

// x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N], all fp32 or all bf16; fp32 accumulation, one rounding
torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_small_m: shapes ", x.sizes(), " ",
              w.sizes());
  TORCH_CHECK(w.is_contiguous(), "linear_small_m: weight must be contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "linear_small_m: weight dtype");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_small_m: x and weight dtypes differ");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                bias->scalar_type() == w.scalar_type(), "linear_small_m: bias must be [N], contiguous, weight dtype");
  }
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (w.scalar_type() == at::kFloat) {
    run<float>(xc.data_ptr<float>(), M, K, w.data_ptr<float>(), N, bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), isa);
  } else {
    std::vector<float> xf(M * K);   // x in fp32 once, shared by every weight row
    const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    auto as_u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run<uint16_t>(xf.data(), M, K, as_u16(w), N, bias ? as_u16(*bias) : nullptr, y.data_ptr<at::BFloat16>(), isa);
  }
  return y;
}

// ---- the streaming bound (a benchmark hook: benchmarks/gemv_quant_micro.py --bound) ---------------------
// How fast a batch-1 GEMV's bytes stream with no arithmetic beside: every byte of rows [0, N) of `rows` (then that
// row's bytes of `side`, e.g. a quantized weight's scales) loaded once in 32-byte vectors, the rows split over
// threads as the GEMVs split them (~64 KiB per task), with the AVX2 kernels' software prefetch at isa 1 and 2.
// Returns an XOR of what was read (read_scalar's), so that nothing is optimized away.
namespace {

// the XOR of a row's 8-byte words (from its start), then of its last bytes one at a time
uint64_t read_scalar(const uint8_t* p, int64_t bytes) {
  uint64_t out = 0;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    out ^= v;
  }
  for (; i < bytes; ++i) out ^= p[i];
  return out;
}

// the same XOR, 64 bytes a step
__attribute__((target("avx2")))
uint64_t read_avx2(const uint8_t* p, int64_t bytes, bool prefetch) {
  __m256i acc = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    if (prefetch) simd::prefetch_stream(p + i);
    acc = _mm256_xor_si256(acc, _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)),
                                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32))));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3] ^ read_scalar(p + i, bytes - i);
}

}  // namespace

int64_t stream_rows(const torch::Tensor& rows, const std::optional<torch::Tensor>& side, int64_t isa) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), "stream_rows: rows must be a contiguous 2-D tensor");
  TORCH_CHECK(!side || (side->dim() == 2 && side->is_contiguous() && side->size(0) == rows.size(0)),
              "stream_rows: side must be a contiguous 2-D tensor with as many rows as rows");
  const int64_t N = rows.size(0), row_bytes = rows.size(1) * rows.element_size();
  const int64_t side_bytes = side ? side->size(1) * side->element_size() : 0;
  const auto* base = static_cast<const uint8_t*>(rows.data_ptr());
  const auto* side_base = side ? static_cast<const uint8_t*>(side->data_ptr()) : nullptr;
  const bool prefetch = isa == 1 || isa == 2;
  auto read = [&](const uint8_t* p, int64_t bytes) { return isa >= 1 ? read_avx2(p, bytes, prefetch) : read_scalar(p, bytes); };
  std::atomic<uint64_t> total{0};
  const int64_t grain = allspark::weight_rows_grain(row_bytes + side_bytes);
  allspark::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    uint64_t mine = 0;
    for (int64_t n = n0; n < n1; ++n) {
      mine ^= read(base + n * row_bytes, row_bytes);
      if (side_base) mine ^= read(side_base + n * side_bytes, side_bytes);
    }
    total.fetch_xor(mine);
  });
  return static_cast<int64_t>(total.load());
}
