// The kernels of this folder as C++ functions (each file documents its layouts): bound to Python in
// module.cpp and composed by decode_block.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t isa);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor spans,
                               torch::Tensor ctx, double scale, int64_t isa);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin, int64_t isa);
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t isa);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
std::tuple<torch::Tensor, torch::Tensor> decode_attention_block(
    torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_weight, double eps,
    torch::Tensor qkv_weight, std::optional<torch::Tensor> qkv_bias, int64_t num_heads, int64_t num_kv_heads,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
    torch::Tensor spans, torch::Tensor ctx, double scale, torch::Tensor o_weight, int64_t isa, int64_t native_rows);
std::tuple<torch::Tensor, torch::Tensor> decode_mlp_block(
    torch::Tensor x, torch::Tensor residual, torch::Tensor norm_weight, double eps, torch::Tensor gate_up_weight,
    std::optional<torch::Tensor> gate_up_bias, torch::Tensor down_weight, int64_t isa, int64_t native_rows);
