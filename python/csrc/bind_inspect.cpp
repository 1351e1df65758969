// bmtrain._C: bmt::inspect (inspect_model statistics, the inspect_tensor scope, record_tensor, format_summary) for
// python/bmtrain/inspect.py. Statistics travel as dicts with BMTrain's keys.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bmt/engine/inspect.h"
#include "py_support.h"

namespace bmt::python {
namespace {

using inspect::TensorStats;

py::object opt(const std::optional<double>& v) { return v ? py::cast(*v) : py::none(); }

py::dict to_dict(const TensorStats& s) {
  py::dict d;
  d["name"] = s.name;
  py::tuple shape(s.shape.size());
  for (size_t i = 0; i < s.shape.size(); ++i) shape[i] = py::int_(s.shape[i]);
  d["shape"] = shape;
  d["mean"] = s.mean;
  d["std"] = s.std;
  d["min"] = s.min;
  d["max"] = s.max;
  d["grad_mean"] = opt(s.grad_mean);
  d["grad_std"] = opt(s.grad_std);
  d["grad_min"] = opt(s.grad_min);
  d["grad_max"] = opt(s.grad_max);
  return d;
}

py::list to_list(const std::vector<TensorStats>& rows) {
  py::list out;
  for (const auto& s : rows) out.append(to_dict(s));
  return out;
}

std::optional<double> get_opt(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return d[key].cast<double>();
}

TensorStats from_dict(const py::dict& d) {
  TensorStats s;
  s.name = d["name"].cast<std::string>();
  for (auto v : d["shape"]) s.shape.push_back(v.cast<int64_t>());
  s.mean = d["mean"].cast<double>();
  s.std = d["std"].cast<double>();
  s.min = d["min"].cast<double>();
  s.max = d["max"].cast<double>();
  s.grad_mean = get_opt(d, "grad_mean");
  s.grad_std = get_opt(d, "grad_std");
  s.grad_min = get_opt(d, "grad_min");
  s.grad_max = get_opt(d, "grad_max");
  return s;
}

py::object tensor_or_none(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

}  // namespace

void bind_inspect(py::module_& m) {
  m.def("inspect_parameters",
        [](const NamedTensors& named, const std::string& pattern) {
          std::vector<TensorStats> rows;
          {
            py::gil_scoped_release release;  // collectives
            rows = inspect::inspect_parameters(named, pattern);
          }
          return to_list(rows);
        },
        py::arg("named"), py::arg("pattern") = "*");
  m.def("record_tensor", &inspect::record_tensor, py::arg("x"), py::arg("name"), py::arg("group") = "");
  m.def("format_summary", [](const py::list& rows) {
    std::vector<TensorStats> v;
    for (auto r : rows) v.push_back(from_dict(r.cast<py::dict>()));
    return inspect::format_summary(v);
  });
  py::class_<inspect::InspectTensor, std::shared_ptr<inspect::InspectTensor>>(m, "InspectTensor")
      .def(py::init<>())
      .def("close", &inspect::InspectTensor::close)
      .def("__len__", &inspect::InspectTensor::size)
      .def("summary",
           [](const inspect::InspectTensor& t) {
             std::vector<TensorStats> rows;
             {
               py::gil_scoped_release release;  // collectives
               rows = t.summary();
             }
             return to_list(rows);
           })
      .def("get_tensor",
           [](const inspect::InspectTensor& t, const std::string& name, const std::string& group, int64_t index) {
             return tensor_or_none(t.get_tensor(name, group, index));
           },
           py::arg("name"), py::arg("group") = "", py::arg("index") = -1)
      .def("get_grad",
           [](const inspect::InspectTensor& t, const std::string& name, const std::string& group, int64_t index) {
             return tensor_or_none(t.get_grad(name, group, index));
           },
           py::arg("name"), py::arg("group") = "", py::arg("index") = -1);
}

}  // namespace bmt::python
