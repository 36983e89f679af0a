// DecodeStack: a whole decode-only step of the model in one call from Python.
//
// Built once per model and KV cache (the weights and cache pages never move after loading), it holds every
// tensor a decode step reads and runs: the embedding rows of the step's tokens (scaled where the model scales
// them), the rotary cos/sin rows of their positions, every layer's steps in order (steps.h: one descriptor per
// step, built from the layer description), the final norm and this rank's LM-head shard, returning fp32 logits.
// After each step that ends in a row-parallel projection (attention, MLP, MoE) the row-parallel sum happens:
// when the model needs it (tensor parallelism, row-parallel biases) `run` is given a Python callable
// reduce(partial, layer, part) (part: the layer's sublayers counted from 0) and calls it with the GIL held;
// at world size 1 without biases the whole step runs without touching Python.
//
// Why: a decode step streams all the weights, which evicts the interpreter's and the dispatcher's working
// set from every cache level, so each Python-level op between kernels runs cold, far slower than the same op in
// a warm loop (docs/performance.md, "Small decode kernels").
//
// With a profile set (a model installed with profiling on), `run` times each of its ops into it (op_profile.h).
//
// The math is exactly the Python path's (the same step functions, in the same order), so logits are bit-equal
// to the loop over DecoderLayer.decode followed by the model's norm and LM head.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "kernels.h"
#include "op_profile.h"
#include "parallel.h"
#include "steps.h"

namespace py = pybind11;

class DecodeStack {
 public:
  // embed_scale: the embedding rows are multiplied by it in the activation dtype (Gemma: sqrt(hidden)); none: not
  DecodeStack(int64_t isa, int64_t native_rows, std::optional<double> embed_scale)
      : isa_(isa), native_rows_(native_rows), embed_scale_(embed_scale) {}

  // one layer: its steps in order (NormStep, AttentionStep, MlpStep or MoeStep objects)
  void add_layer(const std::vector<py::object>& steps) {
    std::vector<Step> layer;
    for (const auto& obj : steps) {
      if (py::isinstance<NormStep>(obj)) {
        auto n = obj.cast<NormStep>();
        n.check();
        layer.emplace_back(std::move(n));
      } else if (py::isinstance<AttentionStep>(obj)) {
        auto a = obj.cast<AttentionStep>();
        a.check();
        count_weights({&a.qkv, &a.o});
        layer.emplace_back(std::move(a));
      } else if (py::isinstance<MlpStep>(obj)) {
        auto m = obj.cast<MlpStep>();
        m.check();
        count_weights({&m.gate_up, &m.down});
        layer.emplace_back(std::move(m));
      } else if (py::isinstance<MoeStep>(obj)) {
        auto m = obj.cast<MoeStep>();
        m.check();
        dense_ = true;   // its router is a dense GEMM
        layer.emplace_back(std::move(m));
      } else {
        TORCH_CHECK(false, "DecodeStack.add_layer: step ", layer.size(), " is not a NormStep, AttentionStep, "
                    "MlpStep or MoeStep");
      }
    }
    TORCH_CHECK(!layer.empty(), "DecodeStack.add_layer: a layer needs steps");
    layers_.push_back(std::move(layer));
  }

  // embedding [V, H]; the rotary tables, fp32 (cos, sin) [max positions, D] each, as AttentionStep.rope_table
  // counts them (none: no rotary); final norm; LM-head shard [V_local, H]
  void set_ends(torch::Tensor embedding, std::vector<std::tuple<torch::Tensor, torch::Tensor>> rotary_tables,
                NormStep final_norm, Weight lm_head) {
    for (const auto& layer : layers_)
      for (const Step& step : layer)
        if (const auto* a = std::get_if<AttentionStep>(&step))
          TORCH_CHECK(!a->rotary || a->rope_table < static_cast<int64_t>(rotary_tables.size()),
                      "DecodeStack.set_ends: an attention step rotates with table ", a->rope_table, " of ",
                      rotary_tables.size());
    embedding_ = embedding;
    rotary_tables_ = rotary_tables;
    final_norm_ = final_norm;
    lm_head_ = lm_head;
    count_weights({&lm_head_});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // where `run` times its ops (op_profile.h); none: profiling off
  void set_profile(std::shared_ptr<allspark::OpProfile> profile) { profile_ = std::move(profile); }

  // ids, positions, slots [B] int64 (one new token per sequence), spans/ctx as in span_attention.cpp
  //   -> fp32 logits [B, V_local] of this rank's LM-head shard
  // all_rows_native: every GEMV native whatever the row count (a speculative verify step, kernels.h ALL_ROWS_NATIVE)
  // lora_slots [B]: each row's LoRA adapter slot (-1: the base model); none: no row uses an adapter
  torch::Tensor run(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots, torch::Tensor spans,
                    torch::Tensor ctx, std::optional<py::function> reduce, bool all_rows_native,
                    std::optional<torch::Tensor> lora_slots) {
    TORCH_CHECK(embedding_.defined() && !layers_.empty(), "DecodeStack.run: call add_layer and set_ends first");
    py::gil_scoped_release nogil;
    allspark::ActiveProfile active(profile_.get());   // null when profiling is off: no op reads a clock
    // every GEMV native: the step's threads are allspark's own (parallel.h says why not otherwise)
    const int64_t batch = ids.size(0);
    const int64_t native_rows = all_rows_native ? ALL_ROWS_NATIVE : native_rows_;
    allspark::OwnPoolScope own_pool((!dense_ || batch <= native_rows) &&
                                    (!quantized_ || all_rows_native || batch <= quant_native_rows(isa_)));
    const auto dtype = embedding_.scalar_type();
    // per rotary table, the rope rows as RotaryEmbedding.cos_sin gives them: [B, 1, D] in the activation dtype
    std::vector<DecodeRows> rows;
    allspark::timed("rope_rows", [&] {
      for (const auto& [cos_table, sin_table] : rotary_tables_)
        rows.push_back({slots, spans, ctx, cos_table.index_select(0, positions).to(dtype).unsqueeze(1),
                        sin_table.index_select(0, positions).to(dtype).unsqueeze(1)});
    });
    if (rows.empty()) rows.push_back({slots, spans, ctx, std::nullopt, std::nullopt});   // no rotary
    const LoraRows lora = lora_rows(lora_slots);
    torch::Tensor x = allspark::timed("embedding", [&] {
      auto e = embedding_.index_select(0, ids);
      return embed_scale_ ? e * torch::scalar_tensor(*embed_scale_, e.options()) : e;
    });
    std::optional<torch::Tensor> residual;
    auto reduced = [&](torch::Tensor partial, int64_t layer, int64_t part) {
      if (!reduce) return partial;
      allspark::OpTimer timer("allreduce");   // the wait for the GIL included
      py::gil_scoped_acquire gil;
      return (*reduce)(partial, layer, part).cast<torch::Tensor>();
    };
    for (int64_t i = 0; i < num_layers(); ++i) {
      int64_t part = 0;
      for (const Step& step : layers_[i]) {
        if (const auto* n = std::get_if<NormStep>(&step)) {
          allspark::OpTimer timer("norm");
          std::tie(x, residual) = norm_step(x, residual, *n, isa_);
        } else if (const auto* a = std::get_if<AttentionStep>(&step)) {
          x = reduced(attention_step(x, *a, rows[a->rotary ? a->rope_table : 0], isa_, native_rows, lora), i,
                      part++);
        } else if (const auto* m = std::get_if<MlpStep>(&step)) {
          x = reduced(mlp_step(x, *m, isa_, native_rows, lora), i, part++);
        } else {
          x = reduced(allspark::timed("moe", [&] { return moe_step(x, std::get<MoeStep>(step), isa_, native_rows); }),
                      i, part++);
        }
      }
    }
    const auto h =
        allspark::timed("final_norm", [&] { return std::get<0>(norm_step(x, residual, final_norm_, isa_)); });
    return allspark::timed("lm_head",
                           [&] { return project(h, lm_head_, std::nullopt, isa_, native_rows).to(torch::kFloat); });
  }

 private:
  // which kinds of weight the step's GEMMs take: each kind is native up to its own number of rows
  void count_weights(std::initializer_list<const Weight*> weights) {
    for (const Weight* w : weights) (std::holds_alternative<QuantWeight>(*w) ? quantized_ : dense_) = true;
  }

  int64_t isa_, native_rows_;
  std::optional<double> embed_scale_;
  bool quantized_ = false, dense_ = false;
  std::vector<std::vector<Step>> layers_;
  torch::Tensor embedding_;
  std::vector<std::tuple<torch::Tensor, torch::Tensor>> rotary_tables_;
  NormStep final_norm_;
  Weight lm_head_;
  std::shared_ptr<allspark::OpProfile> profile_;
};

// One step descriptor's Python class from its field list (steps.h): a default constructor, each field a read/write
// attribute of the same name, FIELDS = [(name, C++ type)] for the binder's check (compute/step_binding.py), and
// check() for the struct's own invariants once every field is set.
template <typename S>
struct StepClass {
  py::class_<S> cls;
  py::list fields;
  template <typename T>
  void field(const char* name, const char* type, T S::*member) {
    cls.def_readwrite(name, member);
    fields.append(py::make_tuple(name, type));
  }
};

#define BIND_STEP_FIELD(type, name) step.field(#name, #type, &Struct::name);
#define BIND_STEP(Name, FIELDS, doc)                         \
  {                                                                   \
    using Struct = Name;                                              \
    StepClass<Name> step{py::class_<Name>(m, #Name, doc), py::list()}; \
    step.cls.def(py::init<>());                                       \
    FIELDS(BIND_STEP_FIELD)                                       \
    step.cls.def("check", &Name::check, "its invariants, once every field is set");  \
    step.cls.attr("FIELDS") = step.fields;                            \
  }

// the step descriptors (steps.h), the single steps and the stack
void bind_decode_stack(py::module_& m) {
  using OptT = std::optional<torch::Tensor>;
  py::class_<LoraSlots>(m, "LoraSlots", "one projection's LoRA adapters by slot: a [R, in], b [out, R] (None: empty)")
      .def(py::init<>())
      .def_readwrite("a", &LoraSlots::a)
      .def_readwrite("b", &LoraSlots::b)
      .def_readwrite("b_panels", &LoraSlots::b_panels)
      .def_readwrite("b_panel_index", &LoraSlots::b_panel_index);
  m.def("lora_add", &lora_add, "y [T, out] += each row's LoRA delta (slots [T], -1: none), in place; returns y",
        py::call_guard<py::gil_scoped_release>(), py::arg("y"), py::arg("x"), py::arg("lora"), py::arg("slots"),
        py::arg("isa"), py::arg("native_rows"));
  BIND_STEP(AttentionOptions, ATTENTION_OPTION_FIELDS, "the attention kernels' options (scale, softcap, window)")
  BIND_STEP(NormStep, NORM_STEP_FIELDS, "RMSNorm of the hidden state (adds_residual: x + residual first)")
  BIND_STEP(AttentionStep, ATTENTION_STEP_FIELDS,
                     "qkv, q/k norms, rotary, cache write, span attention, o projection")
  BIND_STEP(MlpStep, MLP_STEP_FIELDS, "act(gate) * up and the down projection")
  BIND_STEP(MoeStep, MOE_STEP_FIELDS, "a mixture of experts: the router's top-k experts' MLPs, weighted")
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("norm_step", [](torch::Tensor x, OptT residual, const NormStep& n, int64_t isa) {
          return norm_step(x, residual, n, isa);
        }, "(normed, residual) of a NormStep", nogil, py::arg("x"), py::arg("residual"), py::arg("step"),
        py::arg("isa"));
  m.def("attention_step", [](torch::Tensor x, const AttentionStep& a, torch::Tensor slots, torch::Tensor spans,
                             torch::Tensor ctx, OptT cos, OptT sin, int64_t isa, int64_t native_rows,
                             OptT lora_slots) {
          return attention_step(x, a, DecodeRows{slots, spans, ctx, cos, sin}, isa, native_rows,
                                lora_rows(lora_slots));
        }, "an AttentionStep on a decode-only batch: the o projection's output before the allreduce", nogil,
        py::arg("x"), py::arg("step"), py::arg("slots"), py::arg("spans"), py::arg("ctx"), py::arg("cos"),
        py::arg("sin"), py::arg("isa"), py::arg("native_rows"), py::arg("lora_slots") = py::none());
  m.def("mlp_step", [](torch::Tensor x, const MlpStep& mlp, int64_t isa, int64_t native_rows, OptT lora_slots) {
          return mlp_step(x, mlp, isa, native_rows, lora_rows(lora_slots));
        }, "an MlpStep: the down projection's output before the allreduce", nogil,
        py::arg("x"), py::arg("step"), py::arg("isa"), py::arg("native_rows"), py::arg("lora_slots") = py::none());
  m.def("moe_step", &moe_step, "a MoeStep: the experts' weighted sum before the allreduce", nogil, py::arg("x"),
        py::arg("step"), py::arg("isa"), py::arg("native_rows"));
  py::class_<allspark::OpProfile, std::shared_ptr<allspark::OpProfile>>(
      m, "OpProfile", "per op name: count and sum / min / max seconds of the decode stack's ops (op_profile.h)")
      .def(py::init<>())
      .def("stats", &allspark::OpProfile::stats, "[(name, count, sum, min, max)], seconds")
      .def("clear", &allspark::OpProfile::clear);
  py::class_<DecodeStack>(m, "DecodeStack", "a whole decode-only step of the model in one call")
      .def(py::init<int64_t, int64_t, std::optional<double>>(), py::kw_only(), py::arg("isa"), py::arg("native_rows"),
           py::arg("embed_scale") = py::none())
      .def("add_layer", &DecodeStack::add_layer, py::arg("steps"))
      .def("set_ends", &DecodeStack::set_ends, py::kw_only(), py::arg("embedding"), py::arg("rotary_tables"),
           py::arg("final_norm"), py::arg("lm_head"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("set_profile", &DecodeStack::set_profile, "where run times its ops (None: profiling off)",
           py::arg("profile"))
      .def("run", &DecodeStack::run, "fp32 logits of this rank's LM-head shard for a decode-only step (no GIL)",
           py::arg("ids"), py::arg("positions"), py::arg("slots"), py::arg("spans"), py::arg("ctx"),
           py::arg("reduce"), py::arg("all_rows_native") = false, py::arg("lora_slots") = py::none());
}
