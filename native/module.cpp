// The allspark_server._native Python module: binds the kernels of this folder (each file documents
// its layouts). Python reaches them only through allspark_server/compute/ops.py and step_ops.py.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "parallel.h"

void bind_decode_stack(pybind11::module_& m);   // decode_stack.cpp: the step descriptors and the stack

namespace {

// For tests of allspark::parallel_for (own_pool: inside an OwnPoolScope): the chunks it made, in order, as
// (begin, end, ran on the calling thread, a nested call from the chunk ran whole on the same thread); a
// chunk holding `throw_at` throws.
std::vector<std::tuple<int64_t, int64_t, bool, bool>> parallel_chunks(int64_t begin, int64_t end, int64_t grain,
                                                                      int64_t throw_at, bool own_pool) {
  allspark::OwnPoolScope scope(own_pool);
  std::mutex m;
  std::vector<std::tuple<int64_t, int64_t, bool, bool>> chunks;
  const auto caller = std::this_thread::get_id();
  allspark::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    if (b <= throw_at && throw_at < e) throw std::runtime_error("chunk [" + std::to_string(b) + ", " +
                                                                std::to_string(e) + ") failed");
    const auto me = std::this_thread::get_id();
    bool nested_inline = true;
    allspark::parallel_for(0, 64, 1, [&](int64_t nb, int64_t ne) {
      nested_inline = nested_inline && nb == 0 && ne == 64 && std::this_thread::get_id() == me;
    });
    std::lock_guard<std::mutex> lock(m);
    chunks.emplace_back(b, e, me == caller, nested_inline);
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // kernels run without the GIL: other Python threads (gRPC streams, readers of results) go on meanwhile
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("linear_small_m", &linear_small_m, "y = x @ w.T (+ bias) for few rows of x (fp32 accumulation)", nogil,
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("isa"));
  pybind11::class_<QuantWeight>(m, "QuantWeight", "a quantized weight [N, K] (layout in native/gemv_quant.cpp)")
      .def(pybind11::init([](torch::Tensor qweight, torch::Tensor scales, std::optional<torch::Tensor> zeros,
                             int64_t format, int64_t in_features, int64_t act_bits) {
             QuantWeight w{qweight, scales, zeros, format, in_features, act_bits};
             w.check();
             return w;
           }),
           pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("zeros"), pybind11::arg("format"),
           pybind11::arg("in_features"), pybind11::arg("act_bits") = 16)
      .def_readonly("format", &QuantWeight::format)
      .def_readonly("act_bits", &QuantWeight::act_bits)
      .def_readonly("in_features", &QuantWeight::in_features)
      .def("native_at_any_rows", &QuantWeight::native_at_any_rows,
           "every row count of x (prompt rows too) takes the native kernel at this ISA level", pybind11::arg("isa"));
  m.def("stream_rows", &stream_rows, "benchmark hook: read a weight's rows (and each row's side bytes, e.g. scales) as "
        "a batch-1 GEMV streams them, without arithmetic; an XOR of the bytes", nogil, pybind11::arg("rows"),
        pybind11::arg("side"), pybind11::arg("isa"));
  m.def("linear_quant", &linear_quant, "y = x @ dequant(w).T (+ bias) for few rows of x (fp32 FMAs)", nogil,
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("isa"));
  m.def("linear_widened", &linear_widened, "x @ w.T (+ bias) in fp32 over tiles of w widened or dequantized",
        nogil, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("isa"));
  m.def("round_rows", &round_rows, "each row of x rounded to int8 / int16 fixed point as the quantized GEMV "
        "rounds it, returned as fp32 or bf16", nogil, pybind11::arg("x"), pybind11::arg("act_max"),
        pybind11::arg("dtype"), pybind11::arg("isa"));
  m.def("dequantize_weight", &dequantize_weight, "the weight a QuantWeight stands for, as fp32 or bf16 [N, K]",
        nogil, pybind11::arg("w"), pybind11::arg("dtype"), pybind11::arg("isa"));
  m.attr("QUANT_NATIVE_MAX_ROWS") = QUANT_NATIVE_MAX_ROWS;
  m.def("set_batch_invariant", &set_batch_invariant, "every row count on the native kernels, each row summed as "
        "alone (kernels.h)", pybind11::arg("on"));
  m.def("batch_invariant", &batch_invariant, "whether batch-invariant mode is on");
  m.def("quant_native_rows", static_cast<int64_t (*)(int64_t)>(&quant_native_rows),
        "most rows of x the quantized kernels take at this ISA level", pybind11::arg("isa"));
  m.def("quantize_rows_int8", &quantize_rows_int8, "each row of x rounded to int8 as round_rows rounds it (act_max "
        "127): (q int8 [M, K], d fp32 [M])", nogil, pybind11::arg("x"), pybind11::arg("isa"));
  m.def("scale_int_mm", &scale_int_mm, "an int8 GEMM's epilogue: acc * (d[m] * s[n]) (+ bias) in fp32, rounded into "
        "dtype", nogil, pybind11::arg("acc"), pybind11::arg("d"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("dtype"), pybind11::arg("isa"));
  m.def("decode_attention", &decode_attention, "one-token attention per sequence over span KV caches", nogil,
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("spans"),
        pybind11::arg("ctx"), pybind11::arg("options"), pybind11::arg("isa"),
        pybind11::arg("alibi_slopes") = pybind11::none());
  m.def("prefill_attention", &prefill_attention, "a prompt chunk's causal attention over its context's cache slots, "
        "into out", nogil, pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"), pybind11::arg("out"), pybind11::arg("scale"), pybind11::arg("isa"));
  m.def("prefill_attention_supports", &prefill_attention_supports, "whether prefill_attention takes this head dim",
        pybind11::arg("head_dim"));
  m.def("decode_attention_quant", &decode_attention_quant,
        "one-token attention per sequence over quantized (int8 / uint4) span KV caches", nogil, pybind11::arg("q"),
        pybind11::arg("k_codes"), pybind11::arg("k_param"), pybind11::arg("v_codes"), pybind11::arg("v_param"),
        pybind11::arg("spans"), pybind11::arg("ctx"), pybind11::arg("options"), pybind11::arg("isa"),
        pybind11::arg("alibi_slopes") = pybind11::none());
  m.def("store_kv_quant", &store_kv_quant, "quantize k [B, KVH, D] and v [B, KVH*D] rows into their cache slots",
        nogil, pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_codes"), pybind11::arg("k_param"),
        pybind11::arg("v_codes"), pybind11::arg("v_param"), pybind11::arg("slots"));
  m.def("rms_norm", &rms_norm, "(weight * rmsnorm(x + residual), x + residual) in one pass per row", nogil,
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual"),
        pybind11::arg("isa"));
  m.def("rotary", &rotary, "(q, k) rotated by cos/sin rows, HF's rotate-half formula", nogil,
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("isa"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up [T, 2I], HF's roundings", nogil,
        pybind11::arg("gate_up"), pybind11::arg("isa"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate, approximate='tanh') * up for gate_up [T, 2I], HF's roundings",
        nogil, pybind11::arg("gate_up"), pybind11::arg("isa"));
  m.def("softcap_scores", &softcap_scores, "test hook: cap * tanh(x / cap) for fp32 x as the decode attention "
        "soft-caps its scores at this ISA level", nogil, pybind11::arg("x"), pybind11::arg("cap"),
        pybind11::arg("isa"));
  m.def("store_kv", &store_kv, "write k [B, KVH, D] and v [B, KVH*D] rows into their cache slots", nogil,
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"));
  bind_decode_stack(m);
  m.def("parallel_chunks", &parallel_chunks, "test hook: how allspark::parallel_for split [begin, end)", nogil,
        pybind11::arg("begin"), pybind11::arg("end"), pybind11::arg("grain"), pybind11::arg("throw_at"),
        pybind11::arg("own_pool"));
}
