// bmtrain._C.tp: tensor parallelism for the Python package. The bmt.nn parallel layers' forwards are the C++
// layers' (nn/tp_layer_ops.h, the functions nn::ColumnParallelLinear & co. call), the differentiable tp
// communication ops (nn/tp_ops.h), the overlapped sequence-parallel linears (nn/tp_overlap.h) and the gradient
// combination of tp-replicated parameters.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bmt/core/error.h"
#include "bmt/nn/tp_layer_ops.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/nn/tp_overlap.h"
#include "bmt/params/parameter.h"
#include "py_support.h"

namespace bmt::python {
namespace {

at::Tensor opt(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

nn::TpReduce parse_reduce(const std::optional<std::string>& r) {
  if (!r) return nn::TpReduce::kNone;
  if (*r == "all_reduce") return nn::TpReduce::kAllReduce;
  if (*r == "reduce_scatter") return nn::TpReduce::kReduceScatter;
  BMT_ERROR("OpParallelLinear: unknown reduce_output_type '", *r, "': use None, 'all_reduce' or 'reduce_scatter'");
}

TpGradReduce parse_grad_reduce(const std::string& r) {
  if (r == "sum") return TpGradReduce::kSum;
  if (r == "avg") return TpGradReduce::kAvg;
  BMT_ERROR("set_grad_reduce: unknown reduction '", r, "': use 'sum' or 'avg'");
}

}  // namespace

void bind_tp(py::module_& m) {
  py::module_ tp = m.def_submodule("tp", "tensor parallelism over config()['tp_comm'] (nn/tp_layer_ops.h, tp_ops.h)");
  const auto release = py::call_guard<py::gil_scoped_release>();

  // The layers' forwards (weights: the gathered tensors a DistributedModule hands out).
  tp.def(
      "column_parallel_linear",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, bool gather_input,
         bool gather_output, int64_t chunks, bool fp8) {
        return nn::column_parallel_linear(x, w, opt(b), gather_input, gather_output, chunks, fp8);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("gather_input"), py::arg("gather_output"),
      py::arg("overlap_chunks") = 0, py::arg("fp8") = false, release);
  tp.def(
      "row_parallel_linear",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, bool split_input,
         bool all_reduce_output, int64_t chunks, bool fp8) {
        return nn::row_parallel_linear(x, w, opt(b), split_input, all_reduce_output, chunks, fp8);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("split_input"), py::arg("all_reduce_output"),
      py::arg("overlap_chunks") = 0, py::arg("fp8") = false, release);
  tp.def("vocab_parallel_lookup", &nn::vocab_parallel_lookup, py::arg("ids"), py::arg("weight"),
         py::arg("sequence_parallel"), release);
  tp.def("vocab_parallel_lookup_replicated_ids", &nn::vocab_parallel_lookup_replicated_ids, py::arg("ids"),
         py::arg("weight"), py::arg("sequence_parallel"), release);
  tp.def(
      "vocab_parallel_projection",
      [](const at::Tensor& x, const at::Tensor& w, bool sequence_parallel, bool fp8) {
        return nn::vocab_parallel_projection(x, w, sequence_parallel, fp8);
      },
      py::arg("input"), py::arg("weight"), py::arg("sequence_parallel"), py::arg("fp8") = false, release);
  tp.def(
      "op_parallel_linear",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, bool gather_input,
         bool gather_output, bool split_input, const std::optional<std::string>& reduce, int64_t chunks) {
        const nn::TpReduce r = parse_reduce(reduce);
        py::gil_scoped_release unlocked;
        return nn::op_parallel_linear(x, w, opt(b), gather_input, gather_output, split_input, r, chunks);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("gather_input"), py::arg("gather_output"),
      py::arg("split_input"), py::arg("reduce_output_type"), py::arg("overlap_chunks") = 0);
  tp.def(
      "set_grad_reduce", [](const at::Tensor& p, const std::string& r) { set_tp_grad_reduce(p, parse_grad_reduce(r)); },
      py::arg("param"), py::arg("reduce"));
  tp.def(
      "row_parallel_bias_grad_reduce",
      [](bool all_reduce_output) {
        return nn::row_parallel_bias_grad_reduce(all_reduce_output) == TpGradReduce::kAvg ? "avg" : "sum";
      },
      py::arg("all_reduce_output"));

  // The communication ops (forward / backward as tp_ops.h's table).
  tp.def("copy_to_tp", &tp::copy_to_tp, release);
  tp.def("reduce_from_tp", &tp::reduce_from_tp, release);
  tp.def("gather_last_dim", &tp::gather_last_dim, release);
  tp.def("split_last_dim", &tp::split_last_dim, release);
  tp.def("gather_rows", &tp::gather_rows, release);
  tp.def("gather_rows_replicated", &tp::gather_rows_replicated, release);
  tp.def("reduce_scatter_rows", &tp::reduce_scatter_rows, release);
  tp.def("split_rows", &tp::split_rows, release);
  tp.def(
      "gather_rows_linear",
      [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t chunks) {
        return tp::gather_rows_linear(x, weight, opt(bias), chunks);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("chunks") = 2, release);
  tp.def("linear_reduce_scatter_rows", &tp::linear_reduce_scatter_rows, py::arg("input"), py::arg("weight"),
         py::arg("chunks") = 2, release);
  tp.def("overlap_chunks", &tp::overlap_chunks);
  tp.def("set_overlap_chunks", &tp::set_overlap_chunks, py::arg("chunks"));
}

}  // namespace bmt::python
