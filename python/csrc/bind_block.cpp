// bmtrain._C: Blocks and block lists whose forward function is Python code, the fused cross-entropy, the layer
// ops of the C++ nn (linear, layer_norm, gelu_mlp, linear_residual, causal_attention). Tensor parallelism: bind_tp.cpp.
#include <pybind11/stl.h>

#include <optional>

#include "bmt/block.h"
#include "bmt/block_list.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "bmt/nn/attention.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "py_support.h"

namespace bmt::python {
namespace {

// A Block forward function that calls `fn(tensors, context)` in Python. `fn` should not hold its Block strongly
// (the Python Block passes a weak method): the C++ Block keeps it for its whole life.
BlockForward python_forward(py::object fn) {
  auto ref = std::make_shared<PyRef>(std::move(fn));
  return [ref](const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_acquire gil;
    py::object out = ref->get()(inputs, current_call_context_object());
    return out.cast<std::vector<at::Tensor>>();
  };
}

loss::Reduction parse_reduction(const std::string& r) {
  if (r == "mean") return loss::Reduction::kMean;
  if (r == "sum") return loss::Reduction::kSum;
  if (r == "none") return loss::Reduction::kNone;
  BMT_ERROR("FusedCrossEntropy: unknown reduction '", r, "': use mean, sum or none");
}

}  // namespace

void bind_block(py::module_& m) {
  py::class_<Block, std::shared_ptr<Block>>(m, "Block")
      .def(py::init([](std::shared_ptr<torch::nn::Module> holder, py::object forward_fn, int zero_level,
                       bool use_checkpoint, py::object reduce_dtype, const std::string& reduce_op) {
             BlockOptions o;
             o.zero_level = zero_level;
             o.use_checkpoint = use_checkpoint;
             if (!reduce_dtype.is_none()) o.reduce_dtype = reduce_dtype.cast<at::ScalarType>();
             BMT_CHECK(reduce_op == "sum" || reduce_op == "avg", "Block: reduce_op must be 'sum' or 'avg', got '",
                       reduce_op, "'");
             o.reduce_op = reduce_op == "sum" ? core::ReduceOp::kSum : core::ReduceOp::kAvg;
             BlockForward fn = python_forward(std::move(forward_fn));
             py::gil_scoped_release release;  // building the storage gathers every parameter once
             return std::make_shared<Block>(std::move(holder), std::move(fn), o);
           }),
           py::arg("holder"), py::arg("forward_fn"), py::arg("zero_level") = 0, py::arg("use_checkpoint") = true,
           py::arg("reduce_dtype") = py::none(), py::arg("reduce_op") = "sum")
      .def("forward",
           [](Block& b, const std::vector<at::Tensor>& inputs, py::object context) {
             CallContext c = make_call_context(std::move(context));
             py::gil_scoped_release release;
             return b.forward(inputs, std::move(c));
           },
           py::arg("inputs"), py::arg("context") = py::none())
      .def_property_readonly("zero_level", &Block::zero_level)
      .def_property_readonly("use_checkpoint", &Block::use_checkpoint)
      .def_property_readonly("is_gathered", &Block::is_gathered)
      .def("gather", &Block::gather, py::call_guard<py::gil_scoped_release>())
      .def("release", &Block::release, py::call_guard<py::gil_scoped_release>())
      .def("prefetch", &Block::prefetch, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shard_nbytes", &Block::shard_nbytes)
      .def_property_readonly("full_nbytes", &Block::full_nbytes)
      .def_property_readonly("grad_nbytes", &Block::grad_nbytes);

  py::class_<TransformerBlockList, std::shared_ptr<TransformerBlockList>>(m, "TransformerBlockList")
      .def(py::init<std::vector<std::shared_ptr<Block>>, int>(), py::arg("blocks"), py::arg("prefetch_depth") = 1)
      .def("forward",
           [](TransformerBlockList& l, std::vector<at::Tensor> args, int num_hidden, bool return_hidden_states,
              py::object context) {
             CallContext c = make_call_context(std::move(context));
             py::gil_scoped_release release;
             return l.forward(std::move(args), num_hidden, return_hidden_states, std::move(c));
           },
           py::arg("args"), py::arg("num_hidden") = 1, py::arg("return_hidden_states") = false,
           py::arg("context") = py::none())
      .def("__len__", &TransformerBlockList::size)
      .def_property_readonly("prefetch_depth", &TransformerBlockList::prefetch_depth);

  py::class_<GradSyncGuard>(m, "GradSyncGuard").def(py::init<>());
  m.def("grad_sync_enabled", &grad_sync_enabled);

  m.def(
      "fused_cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, const std::string& reduction,
         double label_smoothing, bool parallel, bool inplace) {
        loss::FusedCrossEntropyOptions o;
        o.ignore_index = ignore_index;
        o.reduction = parse_reduction(reduction);
        o.label_smoothing = label_smoothing;
        o.parallel = parallel;
        o.inplace = inplace;
        py::gil_scoped_release release;
        return loss::fused_cross_entropy(logits, target, o);
      },
      py::arg("logits"), py::arg("target"), py::arg("ignore_index") = -100, py::arg("reduction") = "mean",
      py::arg("label_smoothing") = 0.0, py::arg("parallel") = false, py::arg("inplace") = false);
  m.def("check_pending_targets", &loss::check_pending_targets);

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
  nn.def("linear_residual", &bmt::nn::linear_residual, py::arg("input"), py::arg("weight"), py::arg("bias"),
         py::arg("residual"), py::call_guard<py::gil_scoped_release>());
  nn.def("causal_attention", &bmt::nn::causal_attention, py::arg("query"), py::arg("key"), py::arg("value"),
         py::call_guard<py::gil_scoped_release>());
}

}  // namespace bmt::python
