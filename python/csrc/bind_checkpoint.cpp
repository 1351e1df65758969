// bmtrain._C: checkpoints: sharded training-state checkpoints (checkpoint/sharded_checkpoint.h), consolidated
// model files (checkpoint/consolidated.h) and the Hugging Face safetensors import (checkpoint/hf_dir.h).
#include <pybind11/stl.h>

#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/hf_dir.h"
#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/optim/optimizer.h"
#include "py_support.h"

namespace bmt::python {
namespace {

using optim::BmtOptimizer;
using optim::OptimManager;
namespace lrs = optim::lr_scheduler;

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

void bind_checkpoint(py::module_& m) {
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
             d["device_staged"] = s.device_staged;
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
  m.def(
      "save_consolidated",
      [](torch::nn::Module& holder, const std::string& path) {
        ConsolidatedStats s = save(holder, path);
        return s.file_nbytes;
      },
      py::arg("holder"), py::arg("path"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "load_consolidated",
      [](torch::nn::Module& holder, const std::string& path, bool strict) {
        LoadResult r = load(holder, path, strict);
        return std::make_pair(r.missing_keys, r.unexpected_keys);
      },
      py::arg("holder"), py::arg("path"), py::arg("strict") = true, py::call_guard<py::gil_scoped_release>());
  // {key: safetensors dtype name ("F32", "BF16", ...)} of a consolidated file (.safetensors or torch.save's), read
  // from its index only.
  m.def(
      "tensor_file_dtypes",
      [](const std::string& path) {
        std::map<std::string, std::string> out;
        auto reader = checkpoint::open_tensor_file(path);
        for (const auto& t : reader->tensors()) out[t.name] = t.dtype;
        return out;
      },
      py::arg("path"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "load_hf_safetensors",
      [](torch::nn::Module& holder, const std::string& dir,
         const std::map<std::string, std::pair<std::string, bool>>& name_map, bool strict,
         const std::vector<std::string>& ignore) {
        checkpoint::HfNameMap map;
        for (const auto& [ours, src] : name_map) map[ours] = checkpoint::HfSource{src.first, src.second, false};
        checkpoint::HfLoadOptions options;
        options.strict = strict;
        options.ignore.insert(ignore.begin(), ignore.end());
        checkpoint::HfLoadStats stats;
        LoadResult r = checkpoint::load_hf_safetensors(holder, dir, map, options, &stats);
        return std::make_tuple(r.missing_keys, r.unexpected_keys, stats.bytes_copied);
      },
      py::arg("holder"), py::arg("dir"), py::arg("name_map"), py::arg("strict") = true,
      py::arg("ignore") = std::vector<std::string>{}, py::call_guard<py::gil_scoped_release>());
}

}  // namespace bmt::python
