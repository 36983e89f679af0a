// The steps of a decoder layer, as the native decode path receives them: one descriptor struct per step, built
// once per model from the layer description (allspark_server/compute/steps.py says what each option means) and
// holding the step's weights (and, for attention, its layer's KV cache). decode_steps.cpp runs each step on a
// decode-only batch; decode_stack.cpp runs a whole model's layers, step after step, in one call.
//
//   NormStep       x = RMSNorm(x (+ residual)) * w; with adds_residual the sum is the new residual stream
//   AttentionStep  q|k|v = x . W_qkv^T (+ b); [per-head q/k RMSNorm]; rotate q, k (unless ALiBi); write k, v
//                  into their cache slots; o = attention over each sequence's spans (soft-capped scores, a
//                  sliding window); returns o . W_o^T             -- before the tensor-parallel allreduce
//   MlpStep        a = act(x . W_gate^T) * (x . W_up^T) (merged gate|up, + b); returns a . W_down^T  -- ditto
//   MoeStep        the router's top-k experts' MLPs, weighted (moe.cpp)                                -- ditto
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "kernels.h"

enum class Activation : int64_t { Silu = 0, GeluTanh = 1 };

struct NormStep {
  torch::Tensor weight;
  bool adds_residual;
  double eps;
};

struct AttentionStep {
  Weight qkv;
  std::optional<torch::Tensor> qkv_bias;
  Weight o;
  int64_t num_heads, num_kv_heads;
  double scale;
  std::optional<torch::Tensor> q_norm, k_norm;   // per-head norms (eps: norm_eps)
  double norm_eps;
  bool rotary;                                   // false: no rotary (ALiBi models: alibi_slopes instead)
  std::optional<torch::Tensor> alibi_slopes;     // fp32 [num_heads]
  double softcap;                                // 0: none
  int64_t window;                                // 0: every key
  int64_t rope_table;                            // which of the model's rotary tables (decode_stack.cpp)
  torch::Tensor k_cache, v_cache;                // [S, P, KVH, D] dense, or codes with their params
  std::optional<torch::Tensor> k_param, v_param;
  void check() const;
};

struct MlpStep {
  Weight gate_up;
  std::optional<torch::Tensor> gate_up_bias;
  Weight down;
  Activation act;
  void check() const;
};

struct MoeStep {
  torch::Tensor router;
  std::vector<Weight> gate_up, down;
  int64_t top_k;
  bool norm_topk;
  std::optional<Weight> shared_gate_up, shared_down;
  std::optional<torch::Tensor> shared_gate;
  void check() const;
};

using Step = std::variant<NormStep, AttentionStep, MlpStep, MoeStep>;

// the rows of one decode-only step: slots [B] (each new token's cache slot), spans / ctx as in span_attention.cpp,
// cos / sin [B, 1, D] rotary rows in the activation dtype (undefined without rotary)
struct DecodeRows {
  torch::Tensor slots, spans, ctx;
  std::optional<torch::Tensor> cos, sin;
};

// (normed, new residual); without adds_residual the residual passes through unchanged
std::tuple<torch::Tensor, std::optional<torch::Tensor>> norm_step(const torch::Tensor& x,
                                                                  const std::optional<torch::Tensor>& residual,
                                                                  const NormStep& n, int64_t isa);
torch::Tensor attention_step(const torch::Tensor& x, const AttentionStep& a, const DecodeRows& rows, int64_t isa,
                             int64_t native_rows);
torch::Tensor mlp_step(const torch::Tensor& x, const MlpStep& m, int64_t isa, int64_t native_rows);
torch::Tensor moe_step(const torch::Tensor& x, const MoeStep& m, int64_t isa, int64_t native_rows);
