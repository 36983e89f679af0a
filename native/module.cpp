// The allspark_server._native Python module: binds the kernels of this folder (each file documents
// its layouts). Python reaches them only through allspark_server/ops.py.
#include <torch/extension.h>

#include <optional>

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias, int64_t isa);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor spans,
                               torch::Tensor ctx, double scale, int64_t isa);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_small_m", &linear_small_m, "y = x @ w.T (+ bias) for few rows of x (fp32 accumulation)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("isa"));
  m.def("decode_attention", &decode_attention, "one-token attention per sequence over span KV caches",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("spans"),
        pybind11::arg("ctx"), pybind11::arg("scale"), pybind11::arg("isa"));
  m.def("rms_norm", &rms_norm, "(weight * rmsnorm(x + residual), x + residual) in one pass per row",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual"));
  m.def("rotary", &rotary, "(q, k) rotated by cos/sin rows, HF's rotate-half formula",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"));
}
