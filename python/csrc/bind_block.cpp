// bmtrain._C: Blocks and block lists whose forward function is Python code (engine/block.h, engine/block_list.h).
// Tensor parallelism: bind_tp.cpp.
#include <pybind11/stl.h>

#include <optional>

#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/engine/recompute_keep.h"
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

}  // namespace

void bind_block(py::module_& m) {
  // 0 outside a checkpointed Block's forward, 1 its first run (keeping values), 2 the backward's recompute
  // (engine/recompute_keep.h); read by torch_ops.py.
  m.def("recompute_phase", [] { return static_cast<int>(recompute_phase()); });
  // BMT_RECOMPUTE_SKIP_TAIL: the recompute's outputs left uncomputed (engine/recompute_keep.h; recompute_tail.py)
  m.def("recompute_skip_tail_enabled", &recompute_skip_tail_enabled);
  m.def("set_recompute_skip_tail_enabled", &set_recompute_skip_tail_enabled, py::arg("on"));
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

}

}  // namespace bmt::python
