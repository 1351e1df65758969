// bmtrain._C: optimizers, OptimManager, LR schedulers and sharded checkpoints.
#include "bmt/checkpoint/sharded_checkpoint.h"
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
}

checkpoint::TrainingState training_state(torch::nn::Module& holder, const py::list& components, int64_t step) {
  checkpoint::TrainingState st;
  st.model = &holder;
  st.step = step;
  for (py::handle c : components) {
    auto name = c[py::int_(0)].cast<std::string>();
    py::handle obj = c[py::int_(1)];
    if (py::isinstance<OptimManager>(obj)) st.add(name, obj.cast<OptimManager&>());
    else if (py::isinstance<BmtOptimizer>(obj)) st.add(name, obj.cast<BmtOptimizer&>());
    else if (py::isinstance<lrs::WarmupLRScheduler>(obj)) st.add(name, obj.cast<lrs::WarmupLRScheduler&>());
    else BMT_ERROR("checkpoint: component '", name, "' is not an OptimManager, optimizer or LR scheduler");
  }
  return st;
}

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
      .def("flat_params", &BmtOptimizer::flat_params);

  py::class_<AdamBase, BmtOptimizer, std::shared_ptr<AdamBase>>(m, "AdamBase")
      .def("refresh_master", &AdamBase::refresh_master, py::call_guard<py::gil_scoped_release>())
      .def("state_step", [](AdamBase& a, const at::Tensor& p) -> int64_t {
        const optim::AdamState* s = a.find_state(p);
        return s ? s->step : 0;
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

  py::class_<checkpoint::SaveHandle>(m, "SaveHandle")
      .def("wait",
           [](checkpoint::SaveHandle& h) {
             checkpoint::SaveStats s;
             {
               py::gil_scoped_release release;
               s = h.wait();
             }
             py::dict d;
             d["stall_s"] = s.stall_s;
             d["write_s"] = s.write_s;
             d["total_s"] = s.total_s;
             d["rank_nbytes"] = s.rank_nbytes;
             d["total_nbytes"] = s.total_nbytes;
             d["dir"] = s.dir;
             return d;
           })
      .def("done", &checkpoint::SaveHandle::done)
      .def("stall_s", &checkpoint::SaveHandle::stall_s);
  m.def(
      "checkpoint_save",
      [](const std::string& dir, torch::nn::Module& holder, const py::list& components, int64_t step, bool async,
         const std::map<std::string, std::string>& metadata) {
        checkpoint::TrainingState st = training_state(holder, components, step);
        st.user_metadata = metadata;
        checkpoint::SaveOptions o;
        o.async = async;
        py::gil_scoped_release release;
        return checkpoint::save(dir, st, o);
      },
      py::arg("dir"), py::arg("holder"), py::arg("components"), py::arg("step") = 0, py::arg("async_save") = false,
      py::arg("metadata") = std::map<std::string, std::string>{});
  m.def("checkpoint_wait_pending_save", &checkpoint::wait_pending_save, py::call_guard<py::gil_scoped_release>());
  m.def(
      "checkpoint_prepare_async_save",
      [](torch::nn::Module& holder, const py::list& components) {
        checkpoint::TrainingState st = training_state(holder, components, 0);
        py::gil_scoped_release release;
        checkpoint::prepare_async_save(st);
      },
      py::arg("holder"), py::arg("components"));
  m.def(
      "checkpoint_load",
      [](const std::string& dir, torch::nn::Module& holder, const py::list& components, bool strict, bool rng) {
        checkpoint::TrainingState st = training_state(holder, components, 0);
        checkpoint::LoadOptions o;
        o.strict = strict;
        o.rng = rng;
        checkpoint::LoadInfo info;
        {
          py::gil_scoped_release release;
          info = checkpoint::load(dir, st, o);
        }
        py::dict d;
        d["path"] = info.path;
        d["step"] = info.step;
        d["saved_world_size"] = info.saved_world_size;
        d["metadata"] = info.user_metadata;
        d["missing_keys"] = info.missing_keys;
        d["unexpected_keys"] = info.unexpected_keys;
        d["rng_restored"] = info.rng_restored;
        return d;
      },
      py::arg("dir"), py::arg("holder"), py::arg("components"), py::arg("strict") = true, py::arg("rng") = true);
}

}  // namespace bmt::python
