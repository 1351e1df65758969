// bmtrain._C: the layer ops of the C++ nn (linear, layer_norm, gelu_mlp, linear_after_gelu, linear_residual,
// causal_attention), so Python's bmt.nn layers and the routed torch ops (torch_ops.py) get the same kernels.
#include <pybind11/stl.h>

#include <optional>

#include "bmt/nn/attention.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "py_support.h"

namespace bmt::python {

void bind_nn(py::module_& m) {
  // The C++ layers' own ops, so Python's bmt.nn layers get the same kernels (CUDA: our bias / LayerNorm gradient
  // reductions, the GEMM-epilogue MLP; CPU: torch's ops).
  py::module_ nn = m.def_submodule("nn", "bmtrain's layer ops (nn/fused_reductions, nn/fused_linear, nn/attention)");
  const auto opt = [](const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); };
  nn.def(
      "linear",
      [opt](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
        return bmt::nn::linear(x, weight, opt(bias));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  nn.def(
      "layer_norm",
      [opt](const at::Tensor& x, int64_t dim, const std::optional<at::Tensor>& weight,
            const std::optional<at::Tensor>& bias, double eps) {
        return bmt::nn::layer_norm(x, dim, opt(weight), opt(bias), eps);
      },
      py::arg("input"), py::arg("dim"), py::arg("weight") = py::none(), py::arg("bias") = py::none(),
      py::arg("eps") = 1e-5, py::call_guard<py::gil_scoped_release>());
  nn.def(
      "gelu_mlp",
      [opt](const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
            const at::Tensor& b_proj, const std::optional<at::Tensor>& residual) {
        return bmt::nn::gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, opt(residual));
      },
      py::arg("input"), py::arg("w_fc"), py::arg("b_fc"), py::arg("w_proj"), py::arg("b_proj"),
      py::arg("residual") = py::none(), py::call_guard<py::gil_scoped_release>());
  nn.def(
      "linear_after_gelu",
      [opt](const at::Tensor& h, const at::Tensor& pre, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            bool compute) { return bmt::nn::linear_after_gelu(h, pre, weight, opt(bias), compute); },
      py::arg("input"), py::arg("pre"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("compute") = true,
      py::call_guard<py::gil_scoped_release>());
  // A checkpointed Block's recompute of a linear whose output only becomes the Block's output (torch_ops.py):
  // the node without its GEMM, and the GEMM into that output should it be read after all.
  nn.def("linear_deferred", &bmt::nn::linear_deferred, py::arg("input"), py::arg("weight"), py::arg("bias"),
         py::call_guard<py::gil_scoped_release>());
  nn.def(
      "linear_fill",
      [opt](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
        bmt::nn::linear_fill(x, weight, opt(bias), out);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  nn.def("linear_residual", &bmt::nn::linear_residual, py::arg("input"), py::arg("weight"), py::arg("bias"),
         py::arg("residual"), py::call_guard<py::gil_scoped_release>());
  nn.def("causal_attention", &bmt::nn::causal_attention, py::arg("query"), py::arg("key"), py::arg("value"),
         py::call_guard<py::gil_scoped_release>());
}

}  // namespace bmt::python
