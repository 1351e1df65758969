// Glue shared by the bind_*.cpp files of bmtrain._C: Python objects held by C++ (GIL rules), a C++ module tree that
// holds a Python model's tensors (so the C++ API's module-level functions work on Python models), and the
// registration functions each binding file provides.
//
// GIL rules: a binding releases the GIL around engine calls that may block (collectives, CPU Adam, the backward);
// C++ code that calls back into Python (a Block's forward function, an init method) takes it first. A Python object
// that C++ keeps (in a std::function or a Block's call state) is dropped with the GIL held.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/params/parameter.h"

namespace bmt::python {

namespace py = pybind11;

// A Python object owned by C++: copied and destroyed with the GIL held (and not at all once Python is gone).
class PyRef {
 public:
  explicit PyRef(py::object obj);
  PyRef(const PyRef& other);
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef();
  const py::object& get() const { return *obj_; }

 private:
  py::object* obj_;
};

// A Block call context holding a Python object (see Block::current_call_context).
CallContext make_call_context(py::object obj);
// The Python object of the current call context (None when there is none).
py::object current_call_context_object();
// An InitMethod that calls `fn(full_tensor)` in Python (None -> no init method).
InitMethod make_init_method(py::object fn);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// A torch::nn::Module tree holding exactly these tensors under their dotted names ("layers.0.attn.weight"), so the
// C++ module-level API (init_parameters, state_dict, save/load, checkpoints, Blocks) sees a Python model's tensors
// under the Python names. The tensors are the Python objects' own (same TensorImpl): nothing is copied.
std::shared_ptr<torch::nn::Module> make_holder(const NamedTensors& params, const NamedTensors& buffers);

void bind_init(py::module_& m);
void bind_params(py::module_& m);
void bind_block(py::module_& m);
void bind_grad_sync(py::module_& m);
void bind_nn(py::module_& m);
void bind_loss(py::module_& m);
void bind_optim(py::module_& m);
void bind_checkpoint(py::module_& m);
void bind_inspect(py::module_& m);
void bind_estimate(py::module_& m);
void bind_pipeline(py::module_& m);
void bind_nccl(py::module_& m);
void bind_tp(py::module_& m);

}  // namespace bmt::python
