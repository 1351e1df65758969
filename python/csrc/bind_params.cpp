// bmtrain._C: DistributedParameter records, gathering and scattering, and the module-level functions
// (init_parameters, state_dict, load_state_dict) over a holder of a Python model's tensors.
#include "bmt/runtime/init.h"
#include "bmt/params/param_init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "bmt/params/module_state.h"
#include "py_support.h"

namespace bmt::python {
namespace {

// Where a parameter stands (DistributedModule.__getattr__ decides what reading it returns).
enum ParamState : int { kPlain = 0, kStandalone = 1, kInRunningBlock = 2, kInIdleBlock = 3 };

int param_state(const at::Tensor& p) {
  ParamMeta* m = find_meta(p);
  if (!m) return kPlain;
  if (!m->block) return kStandalone;
  return m->block->is_gathered() ? kInRunningBlock : kInIdleBlock;
}

// A bmt::init initialiser in Python (bmtrain.param_init.normal(...) and friends). Given as a DistributedParameter's
// init_method it reaches the engine unchanged, so init_parameters fills shards from its counter-based stream
// (bmt/param_init.h); called on a tensor it fills it in place with torch's generator, like torch.nn.init.
struct PyBuiltinInit {
  InitMethod method;
  std::string repr;
};

// Turns `target` (the tensor a Python DistributedParameter object holds) into a DistributedParameter whose value is
// `data`: the full tensor, or with tp_mode this tp rank's piece of a tensor split along tp_split_dim (-1: replicated
// over the tp group). Only this rank's shard is kept.
void make_distributed(const at::Tensor& target, const at::Tensor& data, py::object init_method, bool tp_mode,
                      int tp_split_dim, std::shared_ptr<core::Communicator> comm) {
  InitMethod init = py::isinstance<PyBuiltinInit>(init_method) ? init_method.cast<const PyBuiltinInit&>().method
                                                                : make_init_method(std::move(init_method));
  py::gil_scoped_release release;
  const Config& cfg = config();
  at::Tensor created;
  if (tp_mode && tp_split_dim >= 0 && cfg.tp_size > 1) {
    BMT_CHECK(tp_split_dim < data.dim(), "DistributedParameter: tp_split_dim ", tp_split_dim,
              " is out of range for a tensor of shape ", data.sizes());
    std::vector<int64_t> logical = data.sizes().vec();
    logical[static_cast<size_t>(tp_split_dim)] *= cfg.tp_size;
    created = TensorParallelParameter(logical, tp_split_dim, data.scalar_type(), std::move(init), false,
                                      "DistributedParameter");
  } else {
    created = DistributedParameter(data.sizes(), data.scalar_type(), std::move(init), false, std::move(comm));
  }
  if (!data.is_meta()) scatter_full(created, data);  // meta: shape only, the shard stays zeros until init
  adopt_distributed_parameter(target, created);
  // BMTrain: a parameter's gradient is in its own dtype, in .grad (outside Blocks; a Block's reduce_dtype rules
  // inside one).
  meta_of(target).grad_dtype = data.scalar_type();
}

NamedTensors named_tensors(const py::iterable& items) {
  NamedTensors out;
  for (py::handle item : items) {
    auto pair = item.cast<std::pair<std::string, at::Tensor>>();
    out.push_back(std::move(pair));
  }
  return out;
}

}  // namespace

void bind_params(py::module_& m) {
  m.def("make_distributed", &make_distributed, py::arg("target"), py::arg("data"), py::arg("init_method") = py::none(),
        py::arg("tp_mode") = false, py::arg("tp_split_dim") = -1, py::arg("comm") = nullptr);
  m.def("reshard_param", &reshard_distributed_parameter, py::arg("param"), py::arg("comm"),
        py::call_guard<py::gil_scoped_release>());
  m.def("is_distributed", &is_distributed_param);
  m.def("param_state", &param_state);
  m.def("logical_shape", [](const at::Tensor& p) { return meta_of(p).logical_shape(); });
  m.def("full_shape", [](const at::Tensor& p) { return meta_of(p).full_shape; });
  m.def("tp_split_dim", [](const at::Tensor& p) { return meta_of(p).is_tp_split() ? meta_of(p).tp_split_dim : -1; });
  m.def("shard_range", [](const at::Tensor& p) {
    const ParamMeta& meta = meta_of(p);
    return std::make_pair(meta.shard_begin, meta.shard_end);
  });
  m.def("param_comm", [](const at::Tensor& p) { return meta_of(p).comm; });
  m.def("gathered", &gathered, py::call_guard<py::gil_scoped_release>());
  m.def("gather_full", &gather_full, py::call_guard<py::gil_scoped_release>());
  m.def("gather_logical", &gather_logical, py::call_guard<py::gil_scoped_release>());
  m.def("scatter_logical", &scatter_logical, py::call_guard<py::gil_scoped_release>());
  m.def("scatter_full", &scatter_full, py::call_guard<py::gil_scoped_release>());
  m.def("main_grad", [](const at::Tensor& p) -> py::object {
    at::Tensor g = main_grad(p);
    if (!g.defined()) return py::none();
    return py::cast(g);
  });

  py::class_<torch::nn::Module, std::shared_ptr<torch::nn::Module>>(m, "ModuleHolder", py::module_local())
      .def("parameter_names", [](torch::nn::Module& h) { return h.named_parameters().keys(); })
      .def("buffer_names", [](torch::nn::Module& h) { return h.named_buffers().keys(); });
  m.def("make_holder", [](const py::iterable& params, const py::iterable& buffers) {
    return make_holder(named_tensors(params), named_tensors(buffers));
  });
  m.def(
      "init_parameters",
      [](torch::nn::Module& holder, std::optional<uint64_t> seed, bool torch_generator) {
        InitParametersOptions o;
        o.seed = seed;
        o.torch_generator = torch_generator;
        init_parameters(holder, o);
      },
      py::arg("holder"), py::arg("seed") = py::none(), py::arg("torch_generator") = false,
      py::call_guard<py::gil_scoped_release>());
  py::class_<PyBuiltinInit>(m, "BuiltinInit")
      .def("__call__", [](const PyBuiltinInit& self, at::Tensor t) {
        {
          at::NoGradGuard guard;
          self.method(t);
        }
        return t;
      })
      .def("__repr__", [](const PyBuiltinInit& self) { return self.repr; });
  auto builtin = [](InitMethod method, std::string repr) { return PyBuiltinInit{std::move(method), std::move(repr)}; };
  m.def("init_normal", [=](double mean, double std) {
    return builtin(init::normal(mean, std), core::concat("normal(mean=", mean, ", std=", std, ")"));
  });
  m.def("init_uniform", [=](double a, double b) {
    return builtin(init::uniform(a, b), core::concat("uniform(a=", a, ", b=", b, ")"));
  });
  m.def("init_constant", [=](double v) { return builtin(init::constant(v), core::concat("constant(", v, ")")); });
  m.def("init_xavier_normal", [=](double gain) {
    return builtin(init::xavier_normal(gain), core::concat("xavier_normal(gain=", gain, ")"));
  });
  m.def("init_xavier_uniform", [=](double gain) {
    return builtin(init::xavier_uniform(gain), core::concat("xavier_uniform(gain=", gain, ")"));
  });
  m.def("state_dict", [](torch::nn::Module& holder, bool to_cpu) { return state_dict(holder, to_cpu); },
        py::arg("holder"), py::arg("to_cpu") = true, py::call_guard<py::gil_scoped_release>());
  m.def(
      "load_state_dict",
      [](torch::nn::Module& holder, const StateDict& sd, bool strict) {
        LoadResult r = load_state_dict(holder, sd, strict);
        return std::make_pair(r.missing_keys, r.unexpected_keys);
      },
      py::arg("holder"), py::arg("state"), py::arg("strict") = true, py::call_guard<py::gil_scoped_release>());
}

}  // namespace bmt::python
