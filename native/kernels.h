// The kernels of this folder as C++ functions (each file documents its layouts): bound to Python in
// module.cpp and composed into the layer description's steps by decode_steps.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "step_options.h"

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t isa);
// benchmark hook (gemv.cpp): read rows (and each row's bytes of side) as a batch-1 GEMV streams them, no arithmetic
int64_t stream_rows(const torch::Tensor& rows, const std::optional<torch::Tensor>& side, int64_t isa);

// A quantized weight [N, K] (layout in gemv_quant.cpp); QuantView is its raw form inside the kernels.
struct QuantView {
  const uint8_t* codes;
  const at::Half* scales;
  const uint8_t* zeros;      // uint8 / uint4 only, else null
  const at::Half* mins;      // uint4_min only (fp16, shaped like scales), else null
  int64_t format, rows, row_bytes, groups, group;
  float act_max;             // x is rounded per row to integers of at most this magnitude (32767 or 127)
};
struct QuantWeight {
  torch::Tensor qweight, scales;
  std::optional<torch::Tensor> zeros;   // the group offsets: uint8 zero points (uint8 / uint4), fp16 mins (uint4_min)
  int64_t format;            // 0 int8, 1 uint8, 2 int4, 3 uint4, 4 uint4_min (allspark_server/quant/formats.py)
  int64_t in_features;       // K
  // how x is rounded before it meets the codes: 16 (weight-only, "A16W8/W4") or 8 (activate_quant, "A8W8")
  int64_t act_bits = 16;
  void check() const;        // shapes and dtypes agree, else a c10::Error naming the problem
  QuantView view() const;
  // every row count of x takes the native kernel at this ISA level, prompt rows too: activate_quant weights in
  // groups of 32 .. 256 on AVX-512 VNNI CPUs (K padded to chunks of 512 by at most a quarter), and 4-bit ones in
  // groups of 32 on AVX2 CPUs, where the lanes kernels (gemv_quant_lanes.cpp, gemv_quant_avx2_lanes.cpp) multiply
  // int8 x with the codes as they are faster than ATen's GEMM meets the dequantized weight at every row count
  // measured (benchmarks/prefill_gemm.py; docs/performance.md, "Choices in the code")
  bool native_at_any_rows(int64_t isa) const;
};
// the weight of a linear layer as the fused blocks take it: dense (fp32/bf16) or quantized
using Weight = std::variant<torch::Tensor, QuantWeight>;
// largest number of rows of x the quantized kernels take (decode batches; above 4 rows they go through the weight a
// tile at a time, gemv_quant.h: tiled_rows); above it the weight is dequantized for ATen's GEMM (prefill), unless
// QuantWeight::native_at_any_rows.
// quant_native_rows(isa): QUANT_NATIVE_MAX_ROWS with the AVX-512 VNNI kernel (isa 3), 16 with the AVX2 and portable
// ones: the GEMM's cost grows far slower with the rows than the GEMV's, and where the two cross depends on the kernel
// (benchmarks/gemv_quant_micro.py --gemm; its numbers: docs/performance.md, "Choices in the code").
constexpr int64_t QUANT_NATIVE_MAX_ROWS = 64;
// Batch-invariant mode (ops.set_batch_invariant, docs/api.md): every row count takes the native kernels (no GEMM
// handover) and none takes a batch-1 kernel that sums in another order, so each row of x comes out as it does alone.
void set_batch_invariant(bool on);
bool batch_invariant();
inline int64_t quant_native_rows(int64_t isa) {
  if (batch_invariant()) return std::numeric_limits<int64_t>::max();
  return isa >= 3 ? QUANT_NATIVE_MAX_ROWS : 16;
}
// the rows of x above which w is dequantized for ATen's GEMM: quant_native_rows(isa), or none
inline int64_t quant_native_rows(int64_t isa, const QuantWeight& w) {
  return w.native_at_any_rows(isa) ? std::numeric_limits<int64_t>::max() : quant_native_rows(isa);
}
torch::Tensor linear_quant(torch::Tensor x, const QuantWeight& w, std::optional<torch::Tensor> bias, int64_t isa);
torch::Tensor dequantize_weight(const QuantWeight& w, at::ScalarType dtype, int64_t isa);
// each row of x [M, K] (fp32 / bf16) as the quantized GEMV rounds it (ops.round_activations_reference, bit for
// bit): q = nearbyint(x * act_max / absmax), times absmax / act_max, returned in `dtype` (fp32, or bf16 rounded to
// nearest even); the activations of a dequantized activate_quant GEMM (prefill, large decode batches)
torch::Tensor round_rows(const torch::Tensor& x, double act_max, at::ScalarType dtype, int64_t isa);
// A8W8 prefill through an int8 GEMM (ops.linear, on CPUs with AMX int8): each row of x (fp32 / bf16) rounded to int8
// as round_rows rounds it with act_max 127: (q int8 [M, K], d fp32 [M]), x ~ q * d
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(const torch::Tensor& x, int64_t isa);
// the int8 GEMM's epilogue: y[m, n] = acc[m, n] * (d[m] * s[n]) (+ b[n]) in fp32, one rounding into `dtype`; acc int32
// [M, N] (torch._int_mm of quantize_rows_int8's q and int8 per-channel codes), s the weight's fp16 scales [N, 1]
torch::Tensor scale_int_mm(const torch::Tensor& acc, const torch::Tensor& d, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& bias, at::ScalarType dtype, int64_t isa);
// x . w^T (+ b) in fp32 for many rows of x (prefill) where oneDNN's bf16 GEMM is slow (no bf16 dot products) or
// w is quantized: w is widened to fp32 (bf16 rows converted, quantized rows dequantized) WIDEN_TILE_BYTES at a
// time, each tile one ATen GEMM into its rows of y^T, so the fp32 copy stays in cache instead of going to fresh
// memory and back (docs/performance.md, "Choices in the code", has the AVX2 VM's numbers). Returns x's dtype.
constexpr int64_t WIDEN_TILE_BYTES = 2 << 20;
torch::Tensor linear_widened(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b,
                             int64_t isa);
// x . w^T (+ b): the native GEMV for few rows (dense: <= native_rows, quantized: <= quant_native_rows(isa)), else
// ATen's GEMM (on the dequantized weight for quantized ones). native_rows == ALL_ROWS_NATIVE: every row count on the
// GEMV, quantized too (a speculative verify step: each row summed as a one-row step sums it)
constexpr int64_t ALL_ROWS_NATIVE = std::numeric_limits<int64_t>::max();
torch::Tensor project(const torch::Tensor& x, const Weight& w, const std::optional<torch::Tensor>& b, int64_t isa,
                      int64_t native_rows);
// options: scale, softcap and window (step_options.h); alibi_slopes [H] fp32 (ALiBi models): key t's score gets
// slope_h * (t - (ctx - 1)), after the soft cap
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor spans,
                               torch::Tensor ctx, const AttentionOptions& options, int64_t isa,
                               std::optional<torch::Tensor> alibi_slopes = std::nullopt);
// test hook (span_attention.cpp): cap * tanh(x / cap) for fp32 x, as the decode attention soft-caps scores at this
// ISA level (2+: AVX-512, 1: AVX2, 0: portable)
torch::Tensor softcap_scores(torch::Tensor x, double cap, int64_t isa);
// prefill_attention.cpp: a prompt chunk's causal attention, q [T, H, D] (row i at position ctx - T + i) over the cache
// slots [ctx] of its context, written into out [T, H, D]; AVX-512 (isa >= 2), fp32 or bf16, head dims of
// prefill_attention_supports
bool prefill_attention_supports(int64_t head_dim);
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                       torch::Tensor out, double scale, int64_t isa);
// quantized KV spans (span_attention_quant.cpp): codes int8 [S, P, KVH, D] or uint8 [.., D/2], params fp32 [.., 2]
torch::Tensor decode_attention_quant(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_param,
                                     torch::Tensor v_codes, torch::Tensor v_param, torch::Tensor spans,
                                     torch::Tensor ctx, const AttentionOptions& options, int64_t isa,
                                     std::optional<torch::Tensor> alibi_slopes = std::nullopt);
void store_kv_quant(torch::Tensor k, torch::Tensor v, torch::Tensor k_codes, torch::Tensor k_param,
                    torch::Tensor v_codes, torch::Tensor v_param, torch::Tensor slots);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual, int64_t isa);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin, int64_t isa);
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa);
// activations.cpp: gelu_tanh(gate) * up for gate_up [T, 2I] -> [T, I] (Gemma 2's MLP), HF's roundings
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up, int64_t isa);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
// moe.cpp: the experts of a mixture-of-experts MLP on a decode step's normed rows
torch::Tensor moe_experts(const torch::Tensor& h, const torch::Tensor& router, const std::vector<Weight>& gate_up,
                          const std::vector<Weight>& down, int64_t top_k, bool norm_topk,
                          const std::optional<Weight>& shared_gate_up, const std::optional<Weight>& shared_down,
                          const std::optional<torch::Tensor>& shared_gate, int64_t isa, int64_t native_rows);
