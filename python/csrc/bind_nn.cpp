// bmtrain._C: the layer ops of the C++ nn (linear, layer_norm, gelu_mlp, linear_after_gelu, linear_residual,
// causal_attention, fp8_linear, fp8_linear_residual, fp8_gelu_mlp), so Python's bmt.nn layers and the routed torch ops (torch_ops.py) get the same kernels.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <utility>

#include "bmt/core/error.h"
#include "bmt/nn/attention.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_mlp.h"
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
  // FP8 formats by name, both ways ("e4m3" / "e5m2"; `who` names the argument in the error).
  const auto fp8_format = [](const std::string& name, const char* who) -> bmt::nn::Fp8Format {
    if (name == "e5m2") return bmt::nn::Fp8Format::kE5M2;
    if (name == "e4m3") return bmt::nn::Fp8Format::kE4M3;
    BMT_ERROR(who, " ", name, " is not 'e4m3' or 'e5m2'");
  };
  const auto format_name = [](bmt::nn::Fp8Format f) {
    return std::string(f == bmt::nn::Fp8Format::kE4M3 ? "e4m3" : "e5m2");
  };
  // FP8 linears (nn/fp8_linear.h): grad_format "e5m2" / "e4m3", or None for the process default (BMT_FP8_GRAD).
  const auto grad_format = [fp8_format](const std::optional<std::string>& name) {
    return name ? fp8_format(*name, "fp8_linear: grad_format") : bmt::nn::fp8_grad_format();
  };
  // scaling "tensor" / "row", or None for the process default (BMT_FP8_SCALING)
  const auto scaling = [](const std::optional<std::string>& name) -> bmt::nn::Fp8Scaling {
    if (!name) return bmt::nn::fp8_scaling();
    if (*name == "tensor") return bmt::nn::Fp8Scaling::kTensor;
    if (*name == "row") return bmt::nn::Fp8Scaling::kRow;
    BMT_ERROR("fp8_linear: scaling ", *name, " is not 'tensor' or 'row'");
  };
  nn.def(
      "fp8_linear",
      [opt, grad_format, scaling](const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const std::optional<std::string>& grad,
                                  const std::optional<std::string>& scale_by, bool compute,
                                  bmt::nn::Fp8LinearScales* scales) {
        return bmt::nn::fp8_linear(x, weight, opt(bias), grad_format(grad), scaling(scale_by), compute, scales);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("grad_format") = py::none(),
      py::arg("scaling") = py::none(), py::arg("compute") = true, py::arg("scales") = py::none(),
      py::call_guard<py::gil_scoped_release>());
  nn.def(
      "fp8_linear_residual",
      [opt, grad_format, scaling](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& residual, const std::optional<std::string>& grad,
                                  const std::optional<std::string>& scale_by, bmt::nn::Fp8LinearScales* scales) {
        return bmt::nn::fp8_linear_residual(x, weight, opt(bias), residual, grad_format(grad), scaling(scale_by),
                                            scales);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("grad_format") = py::none(),
      py::arg("scaling") = py::none(), py::arg("scales") = py::none(), py::call_guard<py::gil_scoped_release>());
  // The delayed scale of the FP8 MLP's GELU output (nn/fp8_delayed_scale.h): the caller keeps one per MLP across
  // steps and passes it to fp8_gelu_mlp (used on its fused CUDA path when fp8_delayed_gelu() is on).
  using DelayedScale = bmt::nn::Fp8DelayedScale;
  py::class_<DelayedScale, std::shared_ptr<DelayedScale>>(
      nn, "Fp8DelayedScale",
      "Fp8DelayedScale(history_len=16, format='e4m3'): the delayed scale of one tensor an FP8 GEMM writes: fp8 max "
      "/ the largest amax of its last history_len calls (a non-finite amax makes that call's outputs NaN, so the step "
      "is skipped, and stays out of the window). ready once a call has recorded an amax; scale (0-dim float32); "
      "history (the amaxes, newest first); record_amax(amax) records a 0-dim float32 amax as a producer would. Not "
      "in checkpoints: a loaded model starts from a dynamic cast. Not in BMTrain.")
      .def(py::init([fp8_format](int64_t history_len, const std::string& format) {
             return std::make_shared<DelayedScale>(history_len, fp8_format(format, "Fp8DelayedScale: format"));
           }),
           py::arg("history_len") = 16, py::arg("format") = "e4m3")
      .def_property_readonly("ready", &DelayedScale::ready)
      .def_property_readonly("history_len", &DelayedScale::history_len)
      .def_property_readonly("format", [format_name](const DelayedScale& s) { return format_name(s.format()); })
      .def_property_readonly("scale", &DelayedScale::scale)
      .def_property_readonly("history",
                             [](const DelayedScale& s) -> std::optional<at::Tensor> {
                               if (!s.history().defined()) return std::nullopt;
                               return s.history();
                             })
      .def("record_amax", &DelayedScale::record_amax, py::arg("amax"))
      // (a copied module starts its own window, as a loaded one does)
      .def("__deepcopy__", [](const DelayedScale& s, const py::dict&) {
        return std::make_shared<DelayedScale>(s.history_len(), s.format());
      });
  // One FP8 linear's delayed scales (its input's and its weight's), as nn::Linear keeps them.
  using LinearScales = bmt::nn::Fp8LinearScales;
  py::class_<LinearScales, std::shared_ptr<LinearScales>>(
      nn, "Fp8LinearScales",
      "Fp8LinearScales(): the delayed scales of one FP8 linear: its forward operands', input and weight (each an "
      "Fp8DelayedScale of 16 calls, E4M3), used by fp8_linear(scales=) under set_fp8_delayed_inputs(True), and its "
      "output gradient's, grad (16 calls, E5M2), used in the backward under set_fp8_delayed_grads(True). Not in "
      "BMTrain.")
      .def(py::init([] { return std::make_shared<LinearScales>(); }))
      .def_property_readonly("input", [](LinearScales& s) -> DelayedScale& { return s.input; },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("weight", [](LinearScales& s) -> DelayedScale& { return s.weight; },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("grad", [](LinearScales& s) -> DelayedScale& { return s.grad; },
                             py::return_value_policy::reference_internal)
      .def_readwrite("backward_only", &LinearScales::backward_only,
                     "True: fp8_linear(scales=) keeps the forward GEMM in the input's dtype, only its two backward "
                     "GEMMs in FP8 (an LM head: exact logits)")
      .def("__deepcopy__", [](const LinearScales&, const py::dict&) { return std::make_shared<LinearScales>(); })
      // (a module holding one pickles: the windows are not state, an unpickled one starts afresh)
      .def(py::pickle([](const LinearScales&) { return py::tuple(); },
                      [](const py::tuple&) { return std::make_shared<LinearScales>(); }));
  nn.def("fp8_recipe", [] { return std::string(bmt::nn::fp8_recipe_name(bmt::nn::fp8_recipe())); });
  nn.def(
      "set_fp8_recipe",
      [](const std::string& name) { bmt::nn::set_fp8_recipe(bmt::nn::fp8_recipe_from_name(name, "set_fp8_recipe")); },
      py::arg("recipe"));
  nn.def("fp8_delayed_gelu", &bmt::nn::fp8_delayed_gelu_enabled);
  nn.def("set_fp8_delayed_gelu", &bmt::nn::set_fp8_delayed_gelu_enabled, py::arg("enabled"));
  nn.def("fp8_delayed_inputs", &bmt::nn::fp8_delayed_inputs_enabled);
  nn.def("set_fp8_delayed_inputs", &bmt::nn::set_fp8_delayed_inputs_enabled, py::arg("enabled"));
  nn.def("fp8_delayed_grads", &bmt::nn::fp8_delayed_grads_enabled);
  nn.def("set_fp8_delayed_grads", &bmt::nn::set_fp8_delayed_grads_enabled, py::arg("enabled"));
  // fp8_gelu_mlp, and fp8_gelu_mlp_fused: the fused function on any device whatever the switches say (CPU: the
  // epilogue GEMMs' fp64 twin; for tests).
  using MlpFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, bmt::nn::Fp8Format, bool, DelayedScale*,
                               LinearScales*, LinearScales*);
  for (const auto& [name, fn] : {std::pair<const char*, MlpFn>{"fp8_gelu_mlp", &bmt::nn::fp8_gelu_mlp},
                                 std::pair<const char*, MlpFn>{"fp8_gelu_mlp_fused", &bmt::nn::fp8_gelu_mlp_fused}}) {
    nn.def(
        name,
        [opt, grad_format, fn = fn](const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                                    const at::Tensor& w_proj, const at::Tensor& b_proj,
                                    const std::optional<at::Tensor>& residual, const std::optional<std::string>& grad,
                                    DelayedScale* gelu_scale, LinearScales* fc_scales, LinearScales* proj_scales) {
          return fn(x, w_fc, b_fc, w_proj, b_proj, opt(residual), grad_format(grad), /*compute_output=*/true,
                    gelu_scale, fc_scales, proj_scales);
        },
        py::arg("input"), py::arg("w_fc"), py::arg("b_fc"), py::arg("w_proj"), py::arg("b_proj"),
        py::arg("residual") = py::none(), py::arg("grad_format") = py::none(), py::arg("gelu_scale") = py::none(),
        py::arg("fc_scales") = py::none(), py::arg("proj_scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  }
  nn.def("fp8_linear_applies", &bmt::nn::fp8_linear_applies, py::arg("input"), py::arg("weight"));
  nn.def("fp8_grad_format", [format_name] { return format_name(bmt::nn::fp8_grad_format()); });
  nn.def("set_fp8_grad_format", [grad_format](const std::string& name) {
    bmt::nn::set_fp8_grad_format(grad_format(name));
  }, py::arg("grad_format"));
  nn.def("fp8_scaling",
         [] { return std::string(bmt::nn::fp8_scaling() == bmt::nn::Fp8Scaling::kRow ? "row" : "tensor"); });
  nn.def("set_fp8_scaling", [scaling](const std::string& name) { bmt::nn::set_fp8_scaling(scaling(name)); },
         py::arg("scaling"));
}

}  // namespace bmt::python
