// bmtrain._C: optimizers, OptimManager and LR schedulers.
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/offload_overlap.h"
#include "bmt/optim/optim_manager.h"
#include "py_support.h"

namespace bmt::python {
namespace {

using optim::AdamBase;
using optim::AdamOffloadOptimizer;
using optim::AdamOptimizer;
using optim::AdamOptions;
using optim::BmtOptimizer;
using optim::OptimManager;
namespace lrs = optim::lr_scheduler;

// Param groups from Python: a list of (params, options dict); options override the defaults by name.
std::vector<torch::optim::OptimizerParamGroup> make_groups(const py::list& groups, const AdamOptions& defaults) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (py::handle g : groups) {
    auto pair = g.cast<std::pair<std::vector<at::Tensor>, py::dict>>();
    AdamOptions o = defaults;
    auto [b1, b2] = o.betas();
    for (auto item : pair.second) {
      const std::string key = item.first.cast<std::string>();
      if (key == "lr") o.lr(item.second.cast<double>());
      else if (key == "betas") std::tie(b1, b2) = item.second.cast<std::pair<double, double>>();
      else if (key == "eps") o.eps(item.second.cast<double>());
      else if (key == "weight_decay") o.weight_decay(item.second.cast<double>());
      else if (key == "hold_steps") o.hold_steps(item.second.cast<int64_t>());
      else if (key == "decoupled_weight_decay") o.decoupled_weight_decay(item.second.cast<bool>());
      // other keys (a group's name, ...) stay on the Python side
    }
    o.betas({b1, b2});
    out.emplace_back(pair.first, std::make_unique<AdamOptions>(o));
  }
  return out;
}

AdamOptions defaults_of(double lr, std::pair<double, double> betas, double eps, double weight_decay,
                        int64_t hold_steps) {
  AdamOptions o(lr, {betas.first, betas.second}, eps, weight_decay);
  o.hold_steps(hold_steps);
  return o;
}

AdamOptions& group_options(BmtOptimizer& opt, size_t g) {
  BMT_CHECK(g < opt.param_groups().size(), "optimizer: param group ", g, " does not exist (", opt.param_groups().size(),
            " groups)");
  return static_cast<AdamOptions&>(opt.param_groups()[g].options());
}

py::dict options_dict(const AdamOptions& o) {
  py::dict d;
  d["lr"] = o.lr();
  d["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
  d["eps"] = o.eps();
  d["weight_decay"] = o.weight_decay();
  d["hold_steps"] = o.hold_steps();
  d["decoupled_weight_decay"] = o.decoupled_weight_decay();
  return d;
}

void set_option(AdamOptions& o, const std::string& key, py::handle value) {
  if (key == "lr") o.lr(value.cast<double>());
  else if (key == "betas") {
    auto b = value.cast<std::pair<double, double>>();
    o.betas({b.first, b.second});
  } else if (key == "eps") o.eps(value.cast<double>());
  else if (key == "weight_decay") o.weight_decay(value.cast<double>());
  else if (key == "hold_steps") o.hold_steps(value.cast<int64_t>());
  else if (key == "decoupled_weight_decay") o.decoupled_weight_decay(value.cast<bool>());
  else BMT_ERROR("optimizer: unknown option '", key, "'");
}

// A Python torch.optim optimizer (torch.optim.SGD, Adam, ...) as the engine's OptimManager sees it: one param group
// holding the same tensors as the Python optimizer's groups (set_params refreshes them), step() runs the Python
// optimizer's step() with the GIL taken. The manager checks these parameters' gradients for inf/NaN, divides them by
// the loss scale and zeros them, as BMTrain's OptimManager does for torch optimizers. Its state belongs to Python:
// save/load (the engine's sharded checkpoint) are refused.
struct PyOptimizerOptions : torch::optim::OptimizerCloneableOptions<PyOptimizerOptions> {};

class PyTorchOptimizer : public torch::optim::Optimizer {
 public:
  PyTorchOptimizer(py::object optimizer, std::vector<at::Tensor> params)
      : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                                std::make_unique<PyOptimizerOptions>()),
        optimizer_(std::move(optimizer)),
        name_(py::str(py::type::of(optimizer_.get()).attr("__name__"))) {
    set_params(std::move(params));
  }

  void set_params(std::vector<at::Tensor> params) {
    param_groups_.clear();
    param_groups_.emplace_back(std::move(params), std::make_unique<PyOptimizerOptions>());
  }

  at::Tensor step(LossClosure closure) override {
    BMT_CHECK(closure == nullptr, "OptimManager: ", name_, ".step() takes no closure here");
    py::gil_scoped_acquire gil;
    optimizer_.get().attr("step")();
    return {};
  }

  void save(torch::serialize::OutputArchive&) const override {
    BMT_ERROR("bmt.save_checkpoint: the OptimManager holds torch.optim.", name_, ", whose state lives in Python; save "
              "it with torch.save(optim_manager.state_dict(), path) (BMTrain's layout) instead");
  }
  void load(torch::serialize::InputArchive&) override {
    BMT_ERROR("bmt.load_checkpoint: the OptimManager holds torch.optim.", name_, ", whose state lives in Python; load "
              "it with optim_manager.load_state_dict(torch.load(path)) instead");
  }

 private:
  PyRef optimizer_;
  std::string name_;
};

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<BmtOptimizer, std::shared_ptr<BmtOptimizer>>(m, "BmtOptimizer")
      .def("step", py::overload_cast<double>(&BmtOptimizer::step), py::arg("loss_scale") = 1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("zero_grad", &BmtOptimizer::zero_grad, py::arg("set_to_none") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("state_dict", &BmtOptimizer::state_dict, py::call_guard<py::gil_scoped_release>())
      .def("load_state_dict", &BmtOptimizer::load_state_dict, py::call_guard<py::gil_scoped_release>())
      .def("num_groups", [](BmtOptimizer& o) { return o.param_groups().size(); })
      .def("group_params", [](BmtOptimizer& o, size_t g) {
        BMT_CHECK(g < o.param_groups().size(), "optimizer: param group ", g, " does not exist");
        return o.param_groups()[g].params();
      })
      .def("group_options", [](BmtOptimizer& o, size_t g) { return options_dict(group_options(o, g)); })
      .def("set_group_option",
           [](BmtOptimizer& o, size_t g, const std::string& key, py::handle v) { set_option(group_options(o, g), key, v); })
      .def("flat_params", &BmtOptimizer::flat_params)
      .def("add_param_group",
           [](BmtOptimizer& o, const std::vector<at::Tensor>& params, const py::dict& options) {
             BMT_CHECK(!o.param_groups().empty(), "optimizer: no param group to take the defaults from");
             py::list groups;
             groups.append(py::make_tuple(params, options));
             auto made = make_groups(groups, group_options(o, 0));
             o.add_param_group(made.front());
           },
           py::arg("params"), py::arg("options"));

  py::class_<AdamBase, BmtOptimizer, std::shared_ptr<AdamBase>>(m, "AdamBase")
      .def("refresh_master", &AdamBase::refresh_master, py::call_guard<py::gil_scoped_release>())
      .def("state_step", [](AdamBase& a, const at::Tensor& p) -> int64_t {
        const optim::AdamState* s = a.find_state(p);
        return s ? s->step : 0;
      })
      // (step, exp_avg, exp_avg_sq, master or None) aliasing the live state, or None before p's first update.
      .def("param_state", [](AdamBase& a, const at::Tensor& p) -> py::object {
        const optim::AdamState* s = a.find_state(p);
        if (s == nullptr) return py::none();
        py::object master = s->master.defined() ? py::cast(s->master) : py::none();
        return py::make_tuple(s->step, s->exp_avg, s->exp_avg_sq, master);
      });

  py::class_<AdamOptimizer, AdamBase, std::shared_ptr<AdamOptimizer>>(m, "AdamOptimizer")
      .def(py::init([](const py::list& groups, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, int64_t hold_steps) {
             return std::make_shared<AdamOptimizer>(make_groups(groups, defaults_of(lr, betas, eps, weight_decay, hold_steps)),
                                                    defaults_of(lr, betas, eps, weight_decay, hold_steps));
           }),
           py::arg("groups"), py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("hold_steps"));

  py::class_<AdamOffloadOptimizer, AdamBase, std::shared_ptr<AdamOffloadOptimizer>>(m, "AdamOffloadOptimizer")
      .def(py::init([](const py::list& groups, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, int64_t hold_steps) {
             return std::make_shared<AdamOffloadOptimizer>(
                 make_groups(groups, defaults_of(lr, betas, eps, weight_decay, hold_steps)),
                 defaults_of(lr, betas, eps, weight_decay, hold_steps));
           }),
           py::arg("groups"), py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("hold_steps"))
      .def("wait", &AdamOffloadOptimizer::wait, py::call_guard<py::gil_scoped_release>())
      .def("set_async_step", &AdamOffloadOptimizer::set_async_step, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("async_step", &AdamOffloadOptimizer::async_step)
      .def("set_grad_transfer_dtype", [](AdamOffloadOptimizer& o, py::object dtype) {
        if (dtype.is_none()) o.set_grad_transfer_dtype(std::nullopt);
        else o.set_grad_transfer_dtype(dtype.cast<at::ScalarType>());
      });

  py::class_<PyTorchOptimizer, std::shared_ptr<PyTorchOptimizer>>(m, "PyTorchOptimizer")
      .def("set_params", &PyTorchOptimizer::set_params);

  py::class_<optim::OffloadOverlap>(m, "OffloadOverlap")
      .def("remove", &optim::OffloadOverlap::remove, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("active", &optim::OffloadOverlap::active)
      .def_property_readonly("num_early_starts", &optim::OffloadOverlap::num_early_starts)
      .def_property_readonly("num_nonfinite_blocks", &optim::OffloadOverlap::num_nonfinite_blocks);

  py::class_<OptimManager, std::shared_ptr<OptimManager>>(m, "OptimManager")
      .def(py::init([](double loss_scale, double factor, int64_t steps, double min_scale, double max_scale,
                       double grad_scale) {
             optim::OptimManagerOptions o;
             o.loss_scale = loss_scale;
             o.loss_scale_factor = factor;
             o.loss_scale_steps = steps;
             o.min_loss_scale = min_scale;
             o.max_loss_scale = max_scale;
             o.grad_scale = grad_scale;
             return std::make_shared<OptimManager>(o);
           }),
           py::arg("loss_scale"), py::arg("loss_scale_factor"), py::arg("loss_scale_steps"), py::arg("min_loss_scale"),
           py::arg("max_loss_scale"), py::arg("grad_scale"))
      .def("add_optimizer",
           [](OptimManager& mgr, std::shared_ptr<BmtOptimizer> opt, std::shared_ptr<lrs::WarmupLRScheduler> sched) {
             mgr.add_optimizer(std::static_pointer_cast<torch::optim::Optimizer>(opt), std::move(sched));
           },
           py::arg("optimizer"), py::arg("lr_scheduler") = nullptr)
      .def("add_torch_optimizer",
           [](OptimManager& mgr, py::object optimizer, std::vector<at::Tensor> params) {
             auto wrapped = std::make_shared<PyTorchOptimizer>(std::move(optimizer), std::move(params));
             mgr.add_optimizer(wrapped);
             return wrapped;
           },
           py::arg("optimizer"), py::arg("params"))
      .def("set_loss_scale_state", &OptimManager::set_loss_scale_state, py::arg("loss_scale"), py::arg("enabled"),
           py::arg("steps_since_last_scale"))
      .def("overlap_offload_with_backward", &OptimManager::overlap_offload_with_backward)
      .def("overlap_step_with_backward", &OptimManager::overlap_step_with_backward, py::arg("release_gradients") = true)
      .def("zero_grad", &OptimManager::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("scale_loss", &OptimManager::scale_loss)
      .def("backward", &OptimManager::backward, py::call_guard<py::gil_scoped_release>())
      .def("step", &OptimManager::step, py::call_guard<py::gil_scoped_release>())
      .def("clip_grad_norm",
           py::overload_cast<const std::vector<at::Tensor>&, double, double, double>(&OptimManager::clip_grad_norm),
           py::arg("params"), py::arg("max_norm"), py::arg("norm_type") = 2.0, py::arg("eps") = 1e-6,
           py::call_guard<py::gil_scoped_release>())
      .def("clip_grad_norm_all",
           py::overload_cast<double, double, double>(&OptimManager::clip_grad_norm), py::arg("max_norm"),
           py::arg("norm_type") = 2.0, py::arg("eps") = 1e-6, py::call_guard<py::gil_scoped_release>())
      .def("state_dict", &OptimManager::state_dict, py::call_guard<py::gil_scoped_release>())
      .def("load_state_dict", &OptimManager::load_state_dict, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("loss_scale", &OptimManager::loss_scale)
      .def_property_readonly("loss_scale_enabled", &OptimManager::loss_scale_enabled)
      .def_property_readonly("steps_since_last_scale", &OptimManager::steps_since_last_scale)
      .def_property_readonly("loss_scale_factor", &OptimManager::loss_scale_factor)
      .def_property_readonly("loss_scale_steps", &OptimManager::loss_scale_steps)
      .def_property_readonly("min_loss_scale", &OptimManager::min_loss_scale)
      .def_property_readonly("max_loss_scale", &OptimManager::max_loss_scale)
      .def_property_readonly("grad_scale", &OptimManager::grad_scale)
      .def_property_readonly("num_skipped_steps", &OptimManager::num_skipped_steps);

  py::class_<lrs::WarmupLRScheduler, std::shared_ptr<lrs::WarmupLRScheduler>>(m, "WarmupLRScheduler")
      .def("lr_at", &lrs::WarmupLRScheduler::lr_at)
      .def("get_lr", &lrs::WarmupLRScheduler::get_lr)
      .def_property_readonly("current_lr", &lrs::WarmupLRScheduler::current_lr)
      .def_property_readonly("num_iter", &lrs::WarmupLRScheduler::num_iter)
      .def_property_readonly("start_lr", &lrs::WarmupLRScheduler::start_lr)
      .def_property_readonly("warmup_iter", &lrs::WarmupLRScheduler::warmup_iter)
      .def_property_readonly("end_iter", &lrs::WarmupLRScheduler::end_iter)
      .def("step", py::overload_cast<>(&lrs::WarmupLRScheduler::step))
      .def("step_to", py::overload_cast<int64_t>(&lrs::WarmupLRScheduler::step))
      .def("warmup_from_zero", [](lrs::WarmupLRScheduler& s, bool on) { s.warmup_from_zero(on); })
      .def("state_dict", &lrs::WarmupLRScheduler::state_dict)
      .def("load_state_dict", &lrs::WarmupLRScheduler::load_state_dict);
  auto opt_ptr = [](std::shared_ptr<BmtOptimizer> o) { return std::static_pointer_cast<torch::optim::Optimizer>(o); };
#define BMT_BIND_SCHEDULER(Cls)                                                                                 \
  py::class_<lrs::Cls, lrs::WarmupLRScheduler, std::shared_ptr<lrs::Cls>>(m, #Cls)                              \
      .def(py::init([opt_ptr](std::shared_ptr<BmtOptimizer> o, double start_lr, int64_t warmup, int64_t end,     \
                              int64_t num_iter) {                                                               \
             return std::make_shared<lrs::Cls>(opt_ptr(o), start_lr, warmup, end, num_iter);                    \
           }),                                                                                                  \
           py::arg("optimizer"), py::arg("start_lr"), py::arg("warmup_iter"), py::arg("end_iter"),             \
           py::arg("num_iter") = 0)
  BMT_BIND_SCHEDULER(NoDecay);
  BMT_BIND_SCHEDULER(Noam);
  BMT_BIND_SCHEDULER(Linear);
  BMT_BIND_SCHEDULER(Cosine);
#undef BMT_BIND_SCHEDULER
  py::class_<lrs::Exponential, lrs::WarmupLRScheduler, std::shared_ptr<lrs::Exponential>>(m, "Exponential")
      .def(py::init([opt_ptr](std::shared_ptr<BmtOptimizer> o, double start_lr, int64_t warmup, int64_t end,
                              int64_t num_iter, double gamma) {
             return std::make_shared<lrs::Exponential>(opt_ptr(o), start_lr, warmup, end, num_iter, gamma);
           }),
           py::arg("optimizer"), py::arg("start_lr"), py::arg("warmup_iter"), py::arg("end_iter"),
           py::arg("num_iter") = 0, py::arg("gamma") = 0.95);
}

}  // namespace bmt::python
