// DecodeStack: a whole decode-only step of the model in one call from Python.
//
// Built once per model and KV cache (the weights and cache pages never move after loading), it holds every
// tensor a decode step reads and runs: the embedding rows of the step's tokens, the rotary cos/sin rows of
// their positions, for every layer the two fused halves of decode_block.cpp, the final norm and this rank's
// LM-head shard, returning fp32 logits. Between the halves the row-parallel sums happen: when the model
// needs them (tensor parallelism, row-parallel biases) `run` is given a Python callable
// reduce(partial, layer, part) (part 0 = o projection, 1 = down projection) and calls it with the GIL held;
// at world size 1 without biases the whole step runs without touching Python.
//
// Why: a decode step streams all the weights, which evicts the interpreter's and the dispatcher's working
// set from every cache level, so each Python-level op between kernels runs cold: measured on a 0.5 B bf16
// model, the layer loop cost ~1.3 ms per token over the fused calls, and the embedding, rope gather, row
// selection and final norm another ~0.3 ms, where the same ops take a few microseconds in a warm loop.
//
// The math is exactly the Python path's (the same functions, in the same order), so logits are bit-equal
// to the loop over DecoderLayer.decode followed by the model's norm and LM head.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace py = pybind11;

namespace {

// a mixture-of-experts MLP half (moe.cpp), in place of the dense one
struct Moe {
  torch::Tensor router;
  std::vector<Weight> gate_up, down;
  int64_t top_k;
  bool norm_topk;
  std::optional<Weight> shared_gate_up, shared_down;
  std::optional<torch::Tensor> shared_gate;
};

struct Layer {
  torch::Tensor attn_norm;
  Weight qkv_w, o_w;
  torch::Tensor mlp_norm;
  std::optional<Weight> gate_up_w, down_w;          // the dense MLP, or none where `moe` is set
  std::optional<Moe> moe;
  torch::Tensor k_cache, v_cache;
  std::optional<torch::Tensor> qkv_b, gate_up_b;
  std::optional<torch::Tensor> k_param, v_param;   // quantized KV spans
  std::optional<torch::Tensor> q_norm, k_norm;     // per-head q/k norms (Qwen3)
};

}  // namespace

class DecodeStack {
 public:
  // alibi_slopes [num_heads] fp32 (ALiBi models: every layer's attention adds the bias; no rotary tables)
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t isa, int64_t native_rows,
              std::optional<torch::Tensor> alibi_slopes)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps), scale_(scale), isa_(isa),
        native_rows_(native_rows), alibi_slopes_(alibi_slopes) {}

  void add_layer(torch::Tensor attn_norm, Weight qkv_w, std::optional<torch::Tensor> qkv_b, Weight o_w,
                 torch::Tensor mlp_norm, std::optional<Weight> gate_up_w, std::optional<torch::Tensor> gate_up_b,
                 std::optional<Weight> down_w,
                 torch::Tensor k_cache, torch::Tensor v_cache, std::optional<torch::Tensor> k_param,
                 std::optional<torch::Tensor> v_param, std::optional<torch::Tensor> q_norm,
                 std::optional<torch::Tensor> k_norm) {
    for (const Weight* w : {&qkv_w, &o_w})
      if (const auto* q = std::get_if<QuantWeight>(w)) q->check();
    for (const auto* w : {&gate_up_w, &down_w})
      if (w->has_value())
        if (const auto* q = std::get_if<QuantWeight>(&**w)) q->check();
    TORCH_CHECK(gate_up_w.has_value() == down_w.has_value(), "DecodeStack.add_layer: gate_up and down, or neither");
    layers_.push_back({attn_norm, qkv_w, o_w, mlp_norm, gate_up_w, down_w, std::nullopt, k_cache, v_cache, qkv_b, gate_up_b,
                       k_param, v_param, q_norm, k_norm});
    quantized_ = quantized_ || std::holds_alternative<QuantWeight>(qkv_w);
  }

  // the last added layer's MLP half is a mixture of experts (its add_layer had no dense MLP weights)
  void set_moe(torch::Tensor router, std::vector<Weight> gate_up, std::vector<Weight> down, int64_t top_k,
               bool norm_topk, std::optional<Weight> shared_gate_up, std::optional<Weight> shared_down,
               std::optional<torch::Tensor> shared_gate) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up_w, "DecodeStack.set_moe: add a layer without a dense MLP first");
    for (const auto* ws : {&gate_up, &down})
      for (const Weight& w : *ws)
        if (const auto* q = std::get_if<QuantWeight>(&w)) q->check();
    layers_.back().moe = Moe{router, gate_up, down, top_k, norm_topk, shared_gate_up, shared_down, shared_gate};
  }

  // embedding [V, H]; fp32 rotary tables [max positions, D] (None: no rotary); final norm [H]; LM-head shard
  // [V_local, H]
  void set_ends(torch::Tensor embedding, std::optional<torch::Tensor> cos_table,
                std::optional<torch::Tensor> sin_table, torch::Tensor final_norm, Weight lm_head) {
    TORCH_CHECK(cos_table.has_value() == sin_table.has_value(), "DecodeStack.set_ends: cos and sin, or neither");
    embedding_ = embedding;
    cos_table_ = cos_table.value_or(torch::Tensor());   // undefined: no rotary
    sin_table_ = sin_table.value_or(torch::Tensor());
    final_norm_ = final_norm;
    lm_head_ = lm_head;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // ids, positions, slots [B] int64 (one new token per sequence), spans/ctx as in span_attention.cpp
  //   -> fp32 logits [B, V_local] of this rank's LM-head shard
  torch::Tensor run(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots, torch::Tensor spans,
                    torch::Tensor ctx, std::optional<py::function> reduce) {
    TORCH_CHECK(embedding_.defined() && !layers_.empty(), "DecodeStack.run: call add_layer and set_ends first");
    py::gil_scoped_release nogil;
    // every GEMV native: the step's threads are allspark's own (parallel.h says why not otherwise)
    const int64_t rows = ids.size(0);
    allspark::OwnPoolScope own_pool(rows <= native_rows_ && (!quantized_ || rows <= QUANT_NATIVE_MAX_ROWS));
    const auto dtype = embedding_.scalar_type();
    // the rope rows as RotaryEmbedding.cos_sin gives them: [B, 1, D] in the activation dtype (none: no rotary)
    std::optional<torch::Tensor> cos, sin;
    if (cos_table_.defined()) {
      cos = cos_table_.index_select(0, positions).to(dtype).unsqueeze(1);
      sin = sin_table_.index_select(0, positions).to(dtype).unsqueeze(1);
    }
    torch::Tensor x = embedding_.index_select(0, ids);
    std::optional<torch::Tensor> residual;
    auto reduced = [&](torch::Tensor partial, int64_t layer, int64_t part) {
      if (!reduce) return partial;
      py::gil_scoped_acquire gil;
      return (*reduce)(partial, layer, part).cast<torch::Tensor>();
    };
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& l = layers_[i];
      auto [o, s] = decode_attention_block(x, residual, l.attn_norm, eps_, l.qkv_w, l.qkv_b, num_heads_,
                                           num_kv_heads_, cos, sin, l.k_cache, l.v_cache, slots, spans, ctx, scale_,
                                           l.o_w, isa_, native_rows_, l.k_param, l.v_param, l.q_norm, l.k_norm,
                                           alibi_slopes_);
      TORCH_CHECK(l.moe || l.gate_up_w, "DecodeStack.run: layer ", i, " has neither a dense MLP nor experts");
      auto [h, s2] = l.moe ? decode_moe_block(reduced(o, i, 0), s, l.mlp_norm, eps_, l.moe->router, l.moe->gate_up,
                                              l.moe->down, l.moe->top_k, l.moe->norm_topk, l.moe->shared_gate_up,
                                              l.moe->shared_down, l.moe->shared_gate, isa_, native_rows_)
                           : decode_mlp_block(reduced(o, i, 0), s, l.mlp_norm, eps_, *l.gate_up_w, l.gate_up_b,
                                              *l.down_w, isa_, native_rows_);
      x = reduced(h, i, 1);
      residual = s2;
    }
    const auto h = std::get<0>(rms_norm(x, final_norm_, eps_, residual, isa_));
    return project(h, lm_head_, std::nullopt, isa_, native_rows_).to(torch::kFloat);
  }

 private:
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_;
  int64_t isa_, native_rows_;
  bool quantized_ = false;
  std::optional<torch::Tensor> alibi_slopes_;
  std::vector<Layer> layers_;
  torch::Tensor embedding_, cos_table_, sin_table_, final_norm_;
  Weight lm_head_;
};

void bind_decode_stack(py::module_& m) {
  py::class_<DecodeStack>(m, "DecodeStack", "a whole decode-only step of the model in one call")
      .def(py::init<int64_t, int64_t, double, double, int64_t, int64_t, std::optional<torch::Tensor>>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"), py::arg("scale"), py::arg("isa"),
           py::arg("native_rows"), py::arg("alibi_slopes") = py::none())
      .def("add_layer", &DecodeStack::add_layer, py::arg("attn_norm"), py::arg("qkv_weight"), py::arg("qkv_bias"),
           py::arg("o_weight"), py::arg("mlp_norm"), py::arg("gate_up_weight"), py::arg("gate_up_bias"),
           py::arg("down_weight"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_param") = py::none(), py::arg("v_param") = py::none(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none())
      .def("set_moe", &DecodeStack::set_moe, py::arg("router"), py::arg("gate_up_weights"), py::arg("down_weights"),
           py::arg("top_k"), py::arg("norm_topk_prob"), py::arg("shared_gate_up"), py::arg("shared_down"),
           py::arg("shared_gate"))
      .def("set_ends", &DecodeStack::set_ends, py::arg("embedding"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("final_norm"), py::arg("lm_head"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run, "fp32 logits of this rank's LM-head shard for a decode-only step (no GIL)",
           py::arg("ids"), py::arg("positions"), py::arg("slots"), py::arg("spans"), py::arg("ctx"),
           py::arg("reduce"));
}
