// The steps of a decoder layer, as the native decode path receives them: one descriptor struct per step, built
// once per model from the layer description (allspark_server/compute/steps.py says what each option means) and
// holding the step's weights (and, for attention, its layer's KV cache). decode_steps.cpp runs each step on a
// decode-only batch; decode_stack.cpp runs a whole model's layers, step after step, in one call.
//
//   NormStep       x = RMSNorm(x (* residual_scale + residual)) * w; with adds_residual the sum is the new
//                  residual stream
//   AttentionStep  q|k|v = x . W_qkv^T (+ b); [per-head q/k RMSNorm]; rotate q, k (unless ALiBi); write k, v
//                  into their cache slots; o = attention over each sequence's spans (soft-capped scores, a
//                  sliding window); returns o . W_o^T             -- before the tensor-parallel allreduce
//   MlpStep        a = act(x . W_gate^T) * (x . W_up^T) (merged gate|up, + b); returns a . W_down^T  -- ditto
//   MoeStep        the router's top-k experts' MLPs, weighted (moe.cpp)                                -- ditto
// The projections of AttentionStep and MlpStep may carry LoRA adapters (LoraSlots): the rows of a step that use
// one (LoraRows) gain B[s] . (A[s] . x) on that projection's output (add_lora, decode_steps.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "kernels.h"

enum class Activation : int64_t { Silu = 0, GeluTanh = 1 };   // compute/steps.py ACTIVATIONS, in order

using OptTensor = std::optional<torch::Tensor>;
using Weights = std::vector<Weight>;
using OptWeight = std::optional<Weight>;

// one projection's LoRA adapters on this rank, by slot (allspark_server/compute/lora_slots.py): a[s] [R_s, in], b[s]
// [out, R_s] with the scale folded in, and b[s] in the decode kernel's layout (compute/step_binding.py lora_panels):
// panels of LORA_PANEL output columns, each holding only its nonzero ranks [lo, hi) rank after rank (b_panels[s]
// [sum of hi - lo, LORA_PANEL]; b_panel_index[s] [panels, 3] int64: lo, hi, where the panel starts in elements);
// none: the slot's adapter leaves this projection alone
constexpr int64_t LORA_PANEL = 16;
struct LoraSlots {
  std::vector<OptTensor> a, b, b_panels, b_panel_index;
  void check() const;
};
using OptLora = std::optional<LoraSlots>;

// a step's rows by adapter slot, slots ascending: each slot's rows; empty: no row uses an adapter
struct LoraGroup {
  int64_t slot;
  std::vector<int64_t> rows;
};
struct LoraRows {
  std::vector<LoraGroup> groups;
  int64_t num_rows = 0;
};
// from each row's slot [B] (-1: the base model); none: no adapters this step (lora.cpp)
LoraRows lora_rows(const OptTensor& slots);
// y [B, out] += each row's adapter delta (lora.cpp says how); nothing without adapters
void add_lora(torch::Tensor& y, const torch::Tensor& x, const OptLora& lora, const LoraRows& rows, int64_t isa,
              int64_t native_rows);
// the same from each row's slot, for ops.lora_add_: returns y
torch::Tensor lora_add(torch::Tensor y, const torch::Tensor& x, const LoraSlots& lora, const torch::Tensor& slots,
                       int64_t isa, int64_t native_rows);

// Each step's fields, written once as F(type, name): the struct, its Python binding (decode_stack.cpp: a
// default constructor, one read/write attribute per field and FIELDS, the [(name, type)] list) and the binder's
// check against compute/steps.py (compute/step_binding.py: every field there, every option here) all come from
// these lists. A field's name is the Python name it is filled from (the bound step's attribute, or its step's).
// residual_scale: a pre-norm adds x * residual_scale (rounded to x's dtype) to the residual stream
#define NORM_STEP_FIELDS(F) \
  F(torch::Tensor, weight) F(bool, adds_residual) F(double, eps) F(double, residual_scale)

// k_cache, v_cache: [S, P, KVH, D] dense, or codes with their params (k_param, v_param); q_norm, k_norm: per-head
// norms (eps: norm_eps); rotary false: no rotary (ALiBi models: alibi_slopes, fp32 [num_heads], instead);
// scale, softcap, window: the attention kernels' options (step_options.h); rope_table: which of the model's rotary tables (decode_stack.cpp)
#define ATTENTION_STEP_FIELDS(F)                                                                   \
  F(Weight, qkv) F(OptTensor, qkv_bias) F(Weight, o) F(int64_t, num_heads) F(int64_t, num_kv_heads)          \
  ATTENTION_OPTION_FIELDS(F) F(OptTensor, q_norm) F(OptTensor, k_norm) F(double, norm_eps) F(bool, rotary)   \
  F(OptTensor, alibi_slopes) F(int64_t, rope_table)                                                         \
  F(torch::Tensor, k_cache) F(torch::Tensor, v_cache) F(OptTensor, k_param) F(OptTensor, v_param)            \
  F(OptLora, qkv_lora) F(OptLora, o_lora)

// activation: an Activation
#define MLP_STEP_FIELDS(F) \
  F(Weight, gate_up) F(OptTensor, gate_up_bias) F(Weight, down) F(int64_t, activation) F(OptLora, gate_up_lora) \
  F(OptLora, down_lora)

#define MOE_STEP_FIELDS(F)                                                                         \
  F(torch::Tensor, router) F(Weights, gate_up) F(Weights, down) F(int64_t, top_k) F(bool, norm_topk_prob)    \
  F(OptWeight, shared_gate_up) F(OptWeight, shared_down) F(OptTensor, shared_gate)

struct NormStep {
  NORM_STEP_FIELDS(DECLARE_STEP_FIELD)
  void check() const;
};

struct AttentionStep {
  ATTENTION_STEP_FIELDS(DECLARE_STEP_FIELD)
  void check() const;
  AttentionOptions options() const {   // the attention kernels' share of the fields
    AttentionOptions out;
    ATTENTION_OPTION_FIELDS(COPY_STEP_FIELD)
    return out;
  }
};

struct MlpStep {
  MLP_STEP_FIELDS(DECLARE_STEP_FIELD)
  void check() const;
};

struct MoeStep {
  MOE_STEP_FIELDS(DECLARE_STEP_FIELD)
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
                             int64_t native_rows, const LoraRows& lora = {});
torch::Tensor mlp_step(const torch::Tensor& x, const MlpStep& m, int64_t isa, int64_t native_rows,
                       const LoraRows& lora = {});
torch::Tensor moe_step(const torch::Tensor& x, const MoeStep& m, int64_t isa, int64_t native_rows);
