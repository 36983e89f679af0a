// What the gated MLP activations share (silu_mul in decode_steps.cpp, gelu_tanh_mul in activations.cpp): a = act(g)
// * u for gate_up [T, 2I] -> [T, I], its checks, its dtype dispatch and its split over threads. `Act` provides
// `template <typename T> static void run(int64_t isa, const T* g, const T* u, int64_t n, T* a)`: one piece of a
// row at the ISA level `isa`.
//
// Rows are cut into pieces of GATED_PIECE columns, so a decode step's one row of 4096+ also runs on every thread
// (on one thread it is slow: the gate half was written by one thread's GEMV rows and the up half by the other's;
// docs/performance.md, "Choices in the code"). Pieces start at multiples of 16, so which
// elements the vector loops leave to the scalar tail (the row's last I % 8 or I % 16) does not depend on the
// split.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"

constexpr int64_t GATED_PIECE = 512;

template <typename Act, typename T>
void gated_rows(const torch::Tensor& gu, torch::Tensor& out, int64_t isa) {
  const int64_t rows = gu.size(0), I = out.size(1);
  const int64_t pieces = (I + GATED_PIECE - 1) / GATED_PIECE;
  const T* g = gu.data_ptr<T>();
  T* o = out.data_ptr<T>();
  allspark::parallel_for(0, rows * pieces, std::max<int64_t>(1, 2048 / GATED_PIECE), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / pieces, c0 = p % pieces * GATED_PIECE, n = std::min(GATED_PIECE, I - c0);
      const T* gate = g + r * 2 * I + c0;
      Act::template run<T>(isa, gate, gate + I, n, o + r * I + c0);
    }
  });
}

// `name`: the op's name in its error messages
template <typename Act>
torch::Tensor gated_mul(const torch::Tensor& gate_up, int64_t isa, const char* name) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, name, ": gate_up must be [T, 2I]");
  auto gu = gate_up.contiguous();
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == at::kFloat) gated_rows<Act, float>(gu, out, isa);
  else if (gu.scalar_type() == at::kBFloat16) gated_rows<Act, at::BFloat16>(gu, out, isa);
  else TORCH_CHECK(false, name, ": fp32 or bf16 only");
  return out;
}
