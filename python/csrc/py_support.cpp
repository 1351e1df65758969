#include "py_support.h"

#include <torch/csrc/utils/pybind.h>

#include "bmt/core/error.h"

namespace bmt::python {

PyRef::PyRef(py::object obj) : obj_(new py::object(std::move(obj))) {}

PyRef::PyRef(const PyRef& other) {
  py::gil_scoped_acquire gil;
  obj_ = new py::object(*other.obj_);
}

PyRef::~PyRef() {
  if (!Py_IsInitialized()) {  // interpreter gone (exit): leak rather than touch it
    obj_->release();
    delete obj_;
    return;
  }
  py::gil_scoped_acquire gil;
  delete obj_;
}

CallContext make_call_context(py::object obj) {
  return std::static_pointer_cast<void>(std::make_shared<PyRef>(std::move(obj)));
}

py::object current_call_context_object() {
  const CallContext& c = Block::current_call_context();
  if (!c) return py::none();
  return static_cast<const PyRef*>(c.get())->get();
}

InitMethod make_init_method(py::object fn) {
  if (fn.is_none()) return nullptr;
  auto ref = std::make_shared<PyRef>(std::move(fn));
  return [ref](at::Tensor& full) {
    py::gil_scoped_acquire gil;
    ref->get()(full);
  };
}

namespace {

torch::nn::Module& child_for(torch::nn::Module& root, const std::string& dotted, std::string& leaf) {
  torch::nn::Module* node = &root;
  size_t start = 0;
  for (size_t dot = dotted.find('.'); dot != std::string::npos; dot = dotted.find('.', start)) {
    const std::string part = dotted.substr(start, dot - start);
    BMT_CHECK(!part.empty(), "bmtrain: empty component in the tensor name '", dotted, "'");
    auto children = node->named_children();
    if (auto* found = children.find(part)) {
      node = found->get();
    } else {
      node = node->register_module(part, std::make_shared<torch::nn::Module>()).get();
    }
    start = dot + 1;
  }
  leaf = dotted.substr(start);
  BMT_CHECK(!leaf.empty(), "bmtrain: empty tensor name in '", dotted, "'");
  return *node;
}

}  // namespace

std::shared_ptr<torch::nn::Module> make_holder(const NamedTensors& params, const NamedTensors& buffers) {
  auto root = std::make_shared<torch::nn::Module>();
  std::string leaf;
  for (const auto& [name, t] : params) {
    torch::nn::Module& owner = child_for(*root, name, leaf);
    owner.register_parameter(leaf, t, t.requires_grad());
  }
  for (const auto& [name, t] : buffers) {
    torch::nn::Module& owner = child_for(*root, name, leaf);
    owner.register_buffer(leaf, t);
  }
  return root;
}

}  // namespace bmt::python
