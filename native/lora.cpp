// LoRA adapters' deltas on a projection's output (steps.h): y[m] += B[s] . (A[s] . x[m]) for the rows m of each
// adapter slot s a step's rows use (LoraRows).
//
// Decode batches (up to FUSED_ROWS rows) take two parallel regions for all their slots together: the shrinks t = A . x,
// their dot products split over the threads, rounded to the activation dtype as PEFT's lora_A(x) is; then the expands
// over the output columns, adding round(B[n] . t) into y, rounded once more (as y + delta in the activation dtype).
// No tensor is allocated and no other op dispatched: at
// batch 1 the adapter's bytes, not the calls around them, are the cost. Each row's sums run in the same order at any
// batch size and with any other slots beside it.
// Larger batches (prefill) go through `project` (kernels.h), two GEMMs a slot.
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

constexpr int64_t FUSED_ROWS = 64;
constexpr int64_t EXPAND_GRAIN = 64;   // output columns: a 576-wide projection is still split over the threads

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// sum_i a[i] * x[i], fp32 (a in T, widened), 32 lanes in four accumulators (a chain of FMAs each: four keep the
// FMA units busy where two left the shrink bound by their latency), then 8 at a time into the first, then the tail
template <typename T>
__attribute__((target("avx2,fma")))
float dot_avx2(const T* a, const float* x, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(simd::load8(a + i + 8 * j), _mm256_loadu_ps(x + i + 8 * j), acc[j]);
  for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(simd::load8(a + i), _mm256_loadu_ps(x + i), acc[0]);
  float s = simd::hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; i < n; ++i) s += widen(a[i]) * x[i];
  return s;
}

template <typename T>
float dot_scalar(const T* a, const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += widen(a[i]) * x[i];
  return s;
}

template <typename T>
inline float dot(const T* a, const float* x, int64_t n, int64_t isa) {
  return isa >= 1 ? dot_avx2(a, x, n) : dot_scalar(a, x, n);
}

// One slot's rows in a step: A [R, K], B^T [R, N] (bt), the rows of x / y it takes, where its rows of x (widened)
// and its shrink results start in the shared buffers
struct SlotRows {
  const void* a;    // in the activation dtype, as is bt
  const void* bt;
  int64_t R;
  const std::vector<int64_t>* rows;
  int64_t x_at, t_at;
};

// acc[i] += s * w[i] (w in T, widened): one FMA per element
template <typename T>
__attribute__((target("avx2,fma")))
void axpy_avx2(float s, const T* w, float* acc, int64_t n) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(sv, simd::load8(w + i), _mm256_loadu_ps(acc + i)));
  for (; i < n; ++i) acc[i] = std::fma(s, widen(w[i]), acc[i]);
}

template <typename T>
inline void axpy(float s, const T* w, float* acc, int64_t n, int64_t isa) {
  if (isa >= 1) {
    axpy_avx2(s, w, acc, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) acc[i] = std::fma(s, widen(w[i]), acc[i]);
}

// every slot's rows of a step in two parallel regions, whatever the number of slots: the shrinks, their (row, rank)
// dot products split over the threads, rounded to the activation dtype as PEFT's lora_A(x) is; then the expands
// over the output columns. A row's sums run in the same order whatever other rows and slots share the step.
template <typename T>
void add_slots(torch::Tensor& y, const torch::Tensor& x, const std::vector<SlotRows>& slots, int64_t isa) {
  const int64_t K = x.size(1), N = y.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  int64_t x_rows = 0, items = 0;
  for (const auto& s : slots) x_rows += s.rows->size(), items += s.rows->size() * s.R;
  // the calling thread's buffers, grown as needed (no allocation per call); the workers reach them through the
  // pointers (a thread_local named inside the lambdas would be each worker's own)
  thread_local std::vector<float> x_buf, t_buf;
  if (static_cast<int64_t>(x_buf.size()) < x_rows * K) x_buf.resize(x_rows * K);
  if (static_cast<int64_t>(t_buf.size()) < items) t_buf.resize(items);
  float* xf = x_buf.data();
  float* t = t_buf.data();
  for (const auto& s : slots)
    for (size_t m = 0; m < s.rows->size(); ++m)
      for (int64_t k = 0; k < K; ++k) xf[(s.x_at + m) * K + k] = widen(xp[(*s.rows)[m] * ldx + k]);
  allspark::parallel_for(0, items, std::max<int64_t>(1, items / 8), [&](int64_t i0, int64_t i1) {
    size_t g = 0;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= slots[g].t_at + static_cast<int64_t>(slots[g].rows->size()) * slots[g].R) ++g;
      const auto& s = slots[g];
      const int64_t j = i - s.t_at, m = j / s.R, r = j % s.R;
      t[i] = widen(static_cast<T>(dot(static_cast<const T*>(s.a) + r * K, xf + (s.x_at + m) * K, K, isa)));
    }
  });
  // columns n0..n1 of each row: acc[n] = sum_r t[m, r] bt[r, n] (r in order, each row of bt swept in turn), then
  // y += round(acc)
  allspark::parallel_for(0, N, EXPAND_GRAIN, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(n1 - n0);
    for (const auto& s : slots)
      for (size_t m = 0; m < s.rows->size(); ++m) {
        std::fill(acc.begin(), acc.end(), 0.f);
        const float* tm = t + s.t_at + m * s.R;
        const T* bt = static_cast<const T*>(s.bt);
        for (int64_t r = 0; r < s.R; ++r) axpy(tm[r], bt + r * N + n0, acc.data(), n1 - n0, isa);
        T* out = yp + (*s.rows)[m] * ldy + n0;
        for (int64_t n = 0; n < n1 - n0; ++n) out[n] = static_cast<T>(widen(out[n]) + widen(static_cast<T>(acc[n])));
      }
  });
}

}  // namespace

void LoraSlots::check() const {
  TORCH_CHECK(a.size() == b.size(), "LoraSlots: ", a.size(), " A slots but ", b.size(), " B slots");
  TORCH_CHECK(bt.empty() || bt.size() == b.size(), "LoraSlots: ", bt.size(), " transposed B slots for ", b.size());
  for (size_t s = 0; s < bt.size(); ++s)
    TORCH_CHECK(bt[s].has_value() == b[s].has_value() &&
                    (!bt[s] || (bt[s]->is_contiguous() && bt[s]->size(0) == b[s]->size(1) &&
                                bt[s]->size(1) == b[s]->size(0) && bt[s]->scalar_type() == b[s]->scalar_type())),
                "LoraSlots: slot ", s, ": the transposed B is not B^T");
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
      out.groups.push_back({p[i], {}, torch::Tensor()});
      it = out.groups.end() - 1;
    }
    it->rows.push_back(i);
  }
  std::sort(out.groups.begin(), out.groups.end(), [](const auto& a, const auto& b) { return a.slot < b.slot; });
  for (auto& g : out.groups)
    if (static_cast<int64_t>(g.rows.size()) < n)
      g.index = torch::tensor(g.rows, torch::TensorOptions().dtype(at::kLong));
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
    if (fused && lora->bt.size() == lora->a.size() && lora->bt[g.slot]) {
      const int64_t R = a->size(0);
      fused_slots.push_back({a->data_ptr(), lora->bt[g.slot]->data_ptr(), R, &g.rows, x_at, t_at});
      x_at += g.rows.size(), t_at += g.rows.size() * R;
      continue;
    }
    const auto xs = g.index.defined() ? x.index_select(0, g.index) : x;
    const auto delta = project(project(xs, *a, std::nullopt, isa, native_rows), b, std::nullopt, isa, native_rows);
    if (g.index.defined()) y.index_add_(0, g.index, delta);
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
