// LoRA adapters' deltas on a projection's output (steps.h): y[m] += B[s] . (A[s] . x[m]) for the rows m of each
// adapter slot s a step's rows use (LoraRows).
//
// Steps of up to FUSED_ROWS rows (decode batches, prompts) take two parallel regions for all their slots together:
// the shrinks t = A . x, their ranks split over the threads (each row of A read once for two rows of x), rounded to the
// activation dtype as PEFT's lora_A(x) is; then the expands over the output columns, adding round(B[n] . t) into y,
// rounded once more (as y + delta in the activation dtype), in registers for up to 4 rows at a time, from B's panels
// (steps.h: a fused projection's zero blocks are never read). With at least as many slots as threads, one region:
// each thread takes whole slots, shrink then expand (a step spread over adapters pays one region start, not two).
// No tensor is allocated and no other op dispatched. Each row's sums run in the same order at any batch size and with
// any other slots beside it.
// Larger steps go through `project` (kernels.h), two GEMMs a slot.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "op_profile.h"
#include "parallel.h"
#include "simd.h"
#include "steps.h"

namespace {

constexpr int64_t FUSED_ROWS = 8192;        // above: two GEMMs a slot (the row buffers grow with the rows)
constexpr int64_t SHRINK_ROW_BLOCK = 32;    // even: the shrink pairs rows
constexpr int64_t EXPAND_GRAIN = 64;   // output columns: a 576-wide projection is still split over the threads

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// sum_i a[i] * x_m[i] for MR rows of x at once (fp32, a in T widened, each element of a loaded once for all of them):
// per row 32 lanes in four accumulators (a chain of FMAs each: four keep the FMA units busy), then 8 at a time into
// the first, then the lanes summed, then the tail by FMAs. A row's sum runs in this order whatever MR is.
template <typename T, int MR>
__attribute__((target("avx2,fma")))
void dot_rows_avx2(const T* a, const float* const* x, int64_t n, float* out) {
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    simd::prefetch_stream(a + i);                  // the adapter is cold: the base weights' stream evicted it
    if constexpr (sizeof(T) == 4) simd::prefetch_stream(a + i + 16);
    for (int j = 0; j < 4; ++j) {
      const __m256 w = simd::load8(a + i + 8 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[m] + i + 8 * j), acc[m][j]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 w = simd::load8(a + i);
    for (int m = 0; m < MR; ++m) acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[m] + i), acc[m][0]);
  }
  for (int m = 0; m < MR; ++m) {
    float s = simd::hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
    for (int64_t k = i; k < n; ++k) s = std::fma(widen(a[k]), x[m][k], s);
    out[m] = s;
  }
}

// the same with AVX-512: per row 64 lanes in four accumulators, then 16 at a time into the first, then the lanes
// summed, then the tail by FMAs (its own order, the same at any MR)
template <typename T, int MR>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void dot_rows_avx512(const T* a, const float* const* x, int64_t n, float* out) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int64_t j = 0; j < 64; j += 64 / static_cast<int64_t>(sizeof(T))) simd::prefetch_stream(a + i + j);
    for (int j = 0; j < 4; ++j) {
      const __m512 w = simd::load16(a + i + 16 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[m] + i + 16 * j), acc[m][j]);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 w = simd::load16(a + i);
    for (int m = 0; m < MR; ++m) acc[m][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[m] + i), acc[m][0]);
  }
  for (int m = 0; m < MR; ++m) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                 _mm512_add_ps(acc[m][2], acc[m][3])));
    for (int64_t k = i; k < n; ++k) s = std::fma(widen(a[k]), x[m][k], s);
    out[m] = s;
  }
}

template <typename T>
float dot_scalar(const T* a, const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s = std::fma(widen(a[i]), x[i], s);
  return s;
}

// One slot's rows in a step: A [R, K], B in panels (steps.h LoraSlots), the rows of x / y it takes, where its rows of
// x (widened) and its shrink results start in the shared buffers
struct SlotRows {
  const void* a;          // in the activation dtype, as are the panels
  const void* panels;
  const int64_t* index;   // [panels, 3]: lo, hi, start
  int64_t R;
  const std::vector<int64_t>* rows;
  int64_t x_at, t_at;
};

// y[m, c0 : c0 + LORA_PANEL] of MB rows at once, in registers, from one panel (its ranks lo..hi-1, LORA_PANEL values
// each, read in sequence): acc = sum_r t[m, r] B[c, r] (one FMA per rank in order r, each value loaded once for the
// MB rows; the ranks outside [lo, hi) are zero in these columns and would add nothing), then y = round(y + round(acc))
template <typename T, int MB>
__attribute__((target("avx2,fma")))
void expand_panel(const T* panel, int64_t lo, int64_t hi, const float* const* t, T* const* y, int64_t c0) {
  constexpr int NV = LORA_PANEL / 8;
  __m256 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t r = lo; r < hi; ++r, panel += LORA_PANEL) {
    simd::prefetch_stream(panel);
    __m256 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = simd::load8(panel + 8 * v);
    for (int m = 0; m < MB; ++m) {
      const __m256 tm = _mm256_set1_ps(t[m][r]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(tm, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) {
      T* out = y[m] + c0 + 8 * v;
      simd::store8(out, _mm256_add_ps(simd::load8(out), simd::round_to8<T>(acc[m][v])));
    }
}

// the same with AVX-512: a panel row is one vector (LORA_PANEL = 16); the same FMAs in the same order, the same bits
template <typename T, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void expand_panel_avx512(const T* panel, int64_t lo, int64_t hi, const float* const* t, T* const* y, int64_t c0) {
  static_assert(LORA_PANEL == 16, "one AVX-512 vector a panel row");
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t r = lo; r < hi; ++r, panel += LORA_PANEL) {
    simd::prefetch_stream(panel);
    const __m512 w = simd::load16(panel);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(t[m][r]), w, acc[m]);
  }
  for (int m = 0; m < MB; ++m) {
    T* out = y[m] + c0;
    simd::store16(out, _mm512_add_ps(simd::load16(out), simd::round_to<T>(acc[m])));
  }
}

// the same for the first `width` columns of a panel, one at a time, any ISA (the last panel, or no AVX2)
template <typename T>
void expand_panel_columns(const T* panel, int64_t lo, int64_t hi, const float* t, T* y, int64_t c0, int64_t width) {
  for (int64_t c = 0; c < width; ++c) {
    float acc = 0.f;
    for (int64_t r = lo; r < hi; ++r) acc = std::fma(t[r], widen(panel[(r - lo) * LORA_PANEL + c]), acc);
    y[c0 + c] = static_cast<T>(widen(y[c0 + c]) + widen(static_cast<T>(acc)));
  }
}

// panels [p0, p1) of MB rows of one slot
template <typename T, int MB>
void expand_rows(const SlotRows& s, int64_t N, const float* const* t, T* const* y, int64_t p0, int64_t p1,
                 int64_t isa) {
  const T* panels = static_cast<const T*>(s.panels);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t lo = s.index[3 * p], hi = s.index[3 * p + 1], c0 = p * LORA_PANEL;
    const T* panel = panels + s.index[3 * p + 2];
    const int64_t width = std::min(LORA_PANEL, N - c0);
    if (isa >= 2 && width == LORA_PANEL) {
      expand_panel_avx512<T, MB>(panel, lo, hi, t, y, c0);
    } else if (isa >= 1 && width == LORA_PANEL) {
      expand_panel<T, MB>(panel, lo, hi, t, y, c0);
    } else {
      for (int m = 0; m < MB; ++m) expand_panel_columns(panel, lo, hi, t[m], y[m], c0, width);
    }
  }
}

// panels [p0, p1) of every row of one slot, 4, 2 or 1 rows at a time
template <typename T>
void expand_slot(const SlotRows& s, int64_t N, const float* t, T* yp, int64_t ldy, int64_t p0, int64_t p1,
                 int64_t isa) {
  const int64_t M = static_cast<int64_t>(s.rows->size());
  for (int64_t m = 0; m < M;) {
    const int64_t take = M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
    const float* tm[4];
    T* ym[4];
    for (int64_t j = 0; j < take; ++j) tm[j] = t + s.t_at + (m + j) * s.R, ym[j] = yp + (*s.rows)[m + j] * ldy;
    if (take == 4) expand_rows<T, 4>(s, N, tm, ym, p0, p1, isa);
    else if (take == 2) expand_rows<T, 2>(s, N, tm, ym, p0, p1, isa);
    else expand_rows<T, 1>(s, N, tm, ym, p0, p1, isa);
    m += take;
  }
}

// the shrink of one rank r of a slot for its rows [m0, m1): t[m, r] = round(A[r] . x[m]), rows two at a time
template <typename T>
void shrink_rank(const SlotRows& s, int64_t r, int64_t m0, int64_t m1, const float* xf, int64_t K, float* t,
                 int64_t isa) {
  const T* a = static_cast<const T*>(s.a) + r * K;
  float out[2];
  for (int64_t m = m0; m < m1;) {
    const float* x[2] = {xf + (s.x_at + m) * K, xf + (s.x_at + std::min(m + 1, m1 - 1)) * K};
    const int take = isa >= 1 && m + 1 < m1 ? 2 : 1;
    if (isa >= 2 && take == 2) dot_rows_avx512<T, 2>(a, x, K, out);
    else if (isa >= 2) dot_rows_avx512<T, 1>(a, x, K, out);
    else if (isa >= 1 && take == 2) dot_rows_avx2<T, 2>(a, x, K, out);
    else if (isa >= 1) dot_rows_avx2<T, 1>(a, x, K, out);
    else out[0] = dot_scalar(a, x[0], K);
    for (int j = 0; j < take; ++j) t[s.t_at + (m + j) * s.R + r] = widen(static_cast<T>(out[j]));
    m += take;
  }
}

// every slot's rows of a step in two parallel regions, whatever the number of slots: the shrinks, their ranks split
// over the threads, rounded to the activation dtype as PEFT's lora_A(x) is; then the expands over the output
// columns. A row's sums run in the same order whatever other rows and slots share the step.
template <typename T>
void add_slots(torch::Tensor& y, const torch::Tensor& x, const std::vector<SlotRows>& slots, int64_t isa) {
  const int64_t K = x.size(1), N = y.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  int64_t x_rows = 0, ranks = 0, t_items = 0, max_rows = 0;
  for (const auto& s : slots) {
    const int64_t M = static_cast<int64_t>(s.rows->size());
    x_rows += M, ranks += s.R, t_items += M * s.R, max_rows = std::max(max_rows, M);
  }
  // the calling thread's buffers, grown as needed (no allocation per call); the workers reach them through the
  // pointers (a thread_local named inside the lambdas would be each worker's own)
  thread_local std::vector<float> x_buf, t_buf;
  if (static_cast<int64_t>(x_buf.size()) < x_rows * K) x_buf.resize(x_rows * K);
  if (static_cast<int64_t>(t_buf.size()) < t_items) t_buf.resize(t_items);
  float* xf = x_buf.data();
  float* t = t_buf.data();
  for (const auto& s : slots)
    for (size_t m = 0; m < s.rows->size(); ++m)
      for (int64_t k = 0; k < K; ++k) xf[(s.x_at + m) * K + k] = widen(xp[(*s.rows)[m] * ldx + k]);
  if (static_cast<int64_t>(slots.size()) >= at::get_num_threads()) {
    // as many slots as threads or more (a batch spread over adapters): one region, a thread taking whole slots,
    // their shrinks and then their expands (no barrier: a slot's expand needs only its own shrinks)
    allspark::parallel_for(0, static_cast<int64_t>(slots.size()), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const SlotRows& s = slots[g];
        const int64_t M = static_cast<int64_t>(s.rows->size());
        for (int64_t m0 = 0; m0 < M; m0 += SHRINK_ROW_BLOCK)
          for (int64_t r = 0; r < s.R; ++r)
            shrink_rank<T>(s, r, m0, std::min(M, m0 + SHRINK_ROW_BLOCK), xf, K, t, isa);
        expand_slot<T>(s, N, t, yp, ldy, 0, (N + LORA_PANEL - 1) / LORA_PANEL, isa);
      }
    });
    return;
  }
  allspark::parallel_for(0, ranks, std::max<int64_t>(1, ranks / 8), [&](int64_t i0, int64_t i1) {
    // blocks of rows (a prompt's), so that each block's x stays in cache while the ranks sweep over it
    for (int64_t m0 = 0; m0 < max_rows; m0 += SHRINK_ROW_BLOCK) {
      size_t g = 0;
      int64_t first = 0;     // the first rank of slots[g]
      for (int64_t i = i0; i < i1; ++i) {
        while (i >= first + slots[g].R) first += slots[g++].R;
        const int64_t M = static_cast<int64_t>(slots[g].rows->size());
        if (m0 < M) shrink_rank<T>(slots[g], i - first, m0, std::min(M, m0 + SHRINK_ROW_BLOCK), xf, K, t, isa);
      }
    }
  });
  const int64_t panels = (N + LORA_PANEL - 1) / LORA_PANEL;
  allspark::parallel_for(0, panels, EXPAND_GRAIN / LORA_PANEL, [&](int64_t p0, int64_t p1) {
    for (const auto& s : slots) expand_slot<T>(s, N, t, yp, ldy, p0, p1, isa);
  });
}

}  // namespace

void LoraSlots::check() const {
  TORCH_CHECK(a.size() == b.size(), "LoraSlots: ", a.size(), " A slots but ", b.size(), " B slots");
  TORCH_CHECK(b_panels.size() == b_panel_index.size() && (b_panels.empty() || b_panels.size() == b.size()),
              "LoraSlots: ", b_panels.size(), " panelled B and ", b_panel_index.size(), " panel indexes for ",
              b.size(), " slots");
  for (size_t s = 0; s < b_panels.size(); ++s) {
    const auto &p = b_panels[s], &i = b_panel_index[s];
    TORCH_CHECK(p.has_value() == b[s].has_value() && i.has_value() == b[s].has_value(), "LoraSlots: slot ", s,
                " has B without its panels or panels without B");
    if (!p) continue;
    const int64_t panels = (b[s]->size(0) + LORA_PANEL - 1) / LORA_PANEL;
    TORCH_CHECK(p->is_contiguous() && p->dim() == 2 && p->size(1) == LORA_PANEL &&
                    p->scalar_type() == b[s]->scalar_type() && i->is_contiguous() && i->scalar_type() == at::kLong &&
                    i->dim() == 2 && i->size(0) == panels && i->size(1) == 3,
                "LoraSlots: slot ", s, ": panels ", p->sizes(), " and index ", i->sizes(), " do not lay out B ",
                b[s]->sizes(), " in panels of ", LORA_PANEL, " columns");
    const int64_t* ip = i->data_ptr<int64_t>();
    for (int64_t q = 0; q < panels; ++q)
      TORCH_CHECK(0 <= ip[3 * q] && ip[3 * q] <= ip[3 * q + 1] && ip[3 * q + 1] <= b[s]->size(1) &&
                      0 <= ip[3 * q + 2] && ip[3 * q + 2] + (ip[3 * q + 1] - ip[3 * q]) * LORA_PANEL <= p->numel(),
                  "LoraSlots: slot ", s, ": panel ", q, " lies outside its ranks or its panels");
  }
  for (size_t s = 0; s < a.size(); ++s) {
    TORCH_CHECK(a[s].has_value() == b[s].has_value(), "LoraSlots: slot ", s, " has A or B alone");
    if (a[s])
      TORCH_CHECK(a[s]->dim() == 2 && b[s]->dim() == 2 && a[s]->size(0) == b[s]->size(1) && a[s]->is_contiguous() &&
                      b[s]->is_contiguous(),
                  "LoraSlots: slot ", s, ": A ", a[s]->sizes(), " and B ", b[s]->sizes(), " do not chain");
  }
}

LoraRows lora_rows(const OptTensor& slots) {
  LoraRows out;
  if (!slots) return out;
  const auto s = slots->to(at::kLong).contiguous();
  const int64_t* p = s.data_ptr<int64_t>();
  const int64_t n = s.numel();
  out.num_rows = n;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0) continue;
    auto it = std::find_if(out.groups.begin(), out.groups.end(), [&](const auto& g) { return g.slot == p[i]; });
    if (it == out.groups.end()) {
      out.groups.push_back({p[i], {}});
      it = out.groups.end() - 1;
    }
    it->rows.push_back(i);
  }
  std::sort(out.groups.begin(), out.groups.end(), [](const auto& a, const auto& b) { return a.slot < b.slot; });
  return out;
}

void add_lora(torch::Tensor& y, const torch::Tensor& x, const OptLora& lora, const LoraRows& rows, int64_t isa,
              int64_t native_rows) {
  if (!lora || rows.groups.empty()) return;
  allspark::OpTimer timer("lora");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == rows.num_rows && y.size(0) == rows.num_rows,
              "add_lora: x ", x.sizes(), " and y ", y.sizes(), " for ", rows.num_rows, " rows");
  const bool fused = rows.num_rows <= FUSED_ROWS && x.stride(1) == 1 && y.stride(1) == 1 &&
                     (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                     y.scalar_type() == x.scalar_type();
  std::vector<SlotRows> fused_slots;
  int64_t x_at = 0, t_at = 0;
  for (const auto& g : rows.groups) {
    TORCH_CHECK(g.slot < static_cast<int64_t>(lora->a.size()), "add_lora: slot ", g.slot, " of ", lora->a.size());
    const auto& a = lora->a[g.slot];
    if (!a) continue;   // this adapter leaves the projection alone
    const auto& b = *lora->b[g.slot];
    TORCH_CHECK(a->size(1) == x.size(1) && b.size(0) == y.size(1) && a->scalar_type() == x.scalar_type() &&
                    b.scalar_type() == x.scalar_type(),
                "add_lora: slot ", g.slot, ": A ", a->sizes(), " and B ", b.sizes(), " do not fit x ", x.sizes(),
                " and y ", y.sizes());
    if (fused && lora->b_panels.size() == lora->a.size() && lora->b_panels[g.slot]) {
      const int64_t R = a->size(0);
      fused_slots.push_back({a->data_ptr(), lora->b_panels[g.slot]->data_ptr(),
                             lora->b_panel_index[g.slot]->data_ptr<int64_t>(), R, &g.rows, x_at, t_at});
      x_at += g.rows.size(), t_at += g.rows.size() * R;
      continue;
    }
    // the slot's rows gathered (unless they are every row), two GEMMs, the delta added back
    const bool some = static_cast<int64_t>(g.rows.size()) < rows.num_rows;
    const auto index = some ? torch::tensor(g.rows, torch::TensorOptions().dtype(at::kLong)) : torch::Tensor();
    const auto xs = some ? x.index_select(0, index) : x;
    const auto delta = project(project(xs, *a, std::nullopt, isa, native_rows), b, std::nullopt, isa, native_rows);
    if (some) y.index_add_(0, index, delta);
    else y.add_(delta);
  }
  if (fused_slots.empty()) return;
  if (x.scalar_type() == at::kFloat) add_slots<float>(y, x, fused_slots, isa);
  else add_slots<at::BFloat16>(y, x, fused_slots, isa);
}

// ops.lora_add_ on the host: the same add_lora the native decode steps run, from each row's slot
torch::Tensor lora_add(torch::Tensor y, const torch::Tensor& x, const LoraSlots& lora, const torch::Tensor& slots,
                       int64_t isa, int64_t native_rows) {
  lora.check();
  add_lora(y, x, OptLora(lora), lora_rows(slots), isa, native_rows);
  return y;
}
