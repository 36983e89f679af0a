// Mixture-of-experts MLP for a decode-only step (layers/moe.py has the math and the Python twin, ops.moe):
//
//   p = softmax(h . W_router^T) in fp32 (h: the normed hidden state); the top k of p per row (divided by
//   their sum when norm_topk); for each expert e in increasing order, over the rows routed to it:
//   out[rows] += (silu(g) * u . W_down[e]^T) * p[rows, e] in fp32, with g|u = h[rows] . W_gate_up[e]^T; plus the
//   shared expert's output times sigmoid(h . w_shared_gate) when there is one; returns out, before the
//   tensor-parallel allreduce (MoeStep in steps.h).
//
// Only the experts some row chose are touched, so a batch-1 step reads k experts' weights, not all of them: the
// active parameters. The projections are `project` (native GEMV for few rows); the routing is a few plain loops
// over E floats (its softmax may differ from torch's in the last bit), a batch of one skips the row gather, and
// the weighted sum is a plain loop: a decode step runs three kernels per chosen expert and little else.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "steps.h"

namespace {

// out[row] += w * y (fp32 rows of H), the product rounded before the sum as `y.float() * w` then index_add_ are
template <typename T>
__attribute__((optimize("fp-contract=off")))
void add_weighted(float* out, const T* y, float w, int64_t H) {
  for (int64_t i = 0; i < H; ++i) out[i] += static_cast<float>(y[i]) * w;
}

void add_rows(torch::Tensor& out, const torch::Tensor& y, const std::vector<int64_t>& rows,
              const std::vector<float>& weights) {
  const int64_t H = out.size(1);
  float* o = out.data_ptr<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (y.scalar_type() == at::kBFloat16)
      add_weighted(o + rows[i] * H, y.data_ptr<at::BFloat16>() + i * H, weights[i], H);
    else
      add_weighted(o + rows[i] * H, y.data_ptr<float>() + i * H, weights[i], H);
  }
}

}  // namespace

torch::Tensor moe_experts(const torch::Tensor& h, const torch::Tensor& router, const std::vector<Weight>& gate_up,
                          const std::vector<Weight>& down, int64_t top_k, bool norm_topk,
                          const std::optional<Weight>& shared_gate_up, const std::optional<Weight>& shared_down,
                          const std::optional<torch::Tensor>& shared_gate, int64_t isa, int64_t native_rows) {
  const int64_t E = static_cast<int64_t>(gate_up.size()), B = h.size(0);
  TORCH_CHECK(E > 0 && static_cast<int64_t>(down.size()) == E && router.size(0) == E,
              "moe_experts: the router and the experts disagree on the number of experts");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_experts: top_k ", top_k, " outside 1..", E);
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() && shared_down.has_value() == shared_gate.has_value(),
              "moe_experts: the shared expert needs its gate_up, down and gate weights");
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat, "moe_experts: fp32 or bf16");
  const auto logits = project(h, router, std::nullopt, isa, native_rows).to(torch::kFloat).contiguous();
  auto out = torch::zeros(h.sizes(), h.options().dtype(torch::kFloat));
  // routing, per row: softmax over the E logits, the top k (the lower id first among equals), renormalized;
  // then the rows per expert, in row order (a row picks an expert at most once), with their weights
  std::vector<std::vector<int64_t>> rows(E);
  std::vector<std::vector<float>> row_weights(E);
  std::vector<float> p(E);
  std::vector<int64_t> order(E);
  const float* lg = logits.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    const float* l = lg + r * E;
    const float m = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      rows[order[j]].push_back(r);
      row_weights[order[j]].push_back(norm_topk ? p[order[j]] / chosen : p[order[j]]);
    }
  }
  for (int64_t e = 0; e < E; ++e) {      // only the chosen experts' weights are read
    if (rows[e].empty()) continue;
    const bool all_rows = static_cast<int64_t>(rows[e].size()) == B;   // a batch of one: no gather
    const auto x = all_rows ? h : h.index_select(0, torch::tensor(rows[e], torch::kLong));
    const auto y = project(silu_mul(project(x, gate_up[e], std::nullopt, isa, native_rows), isa), down[e],
                           std::nullopt, isa, native_rows).contiguous();
    add_rows(out, y, rows[e], row_weights[e]);
  }
  if (shared_gate_up) {
    const auto y = project(silu_mul(project(h, *shared_gate_up, std::nullopt, isa, native_rows), isa), *shared_down,
                           std::nullopt, isa, native_rows);
    out += torch::sigmoid(project(h, *shared_gate, std::nullopt, isa, native_rows).to(torch::kFloat)) *
           y.to(torch::kFloat);
  }
  return out.to(h.scalar_type());
}

void MoeStep::check() const {
  TORCH_CHECK(router.defined() && !gate_up.empty() && gate_up.size() == down.size(),
              "MoeStep: a router and each expert's gate_up and down");
  TORCH_CHECK(top_k >= 1 && top_k <= static_cast<int64_t>(gate_up.size()), "MoeStep: top_k ", top_k, " of ",
              gate_up.size(), " experts");
  for (const auto* ws : {&gate_up, &down})
    for (const Weight& w : *ws)
      if (const auto* q = std::get_if<QuantWeight>(&w)) q->check();
  for (const auto* w : {&shared_gate_up, &shared_down})
    if (w->has_value())
      if (const auto* q = std::get_if<QuantWeight>(&**w)) q->check();
}

torch::Tensor moe_step(const torch::Tensor& x, const MoeStep& m, int64_t isa, int64_t native_rows) {
  return moe_experts(x, m.router, m.gate_up, m.down, m.top_k, m.norm_topk_prob, m.shared_gate_up, m.shared_down,
                     m.shared_gate, isa, native_rows);
}
