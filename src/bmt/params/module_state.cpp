#include "bmt/params/module_state.h"

#include <sstream>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/parameter.h"
#include "bmt/params/pending_update.h"

namespace bmt {
namespace {

// The one place module-level reads and writes of parameters wait: an asynchronous optimizer step may still be
// writing them (pending_update.h); its result would be read half-done or overwrite the new values.
void wait_for_parameter_writers() { wait_all_pending_updates(); }

}  // namespace

StateDict state_dict(torch::nn::Module& module, bool to_cpu) {
  wait_for_parameter_writers();
  StateDict out;
  at::NoGradGuard guard;
  for (auto& item : module.named_parameters(true)) {
    at::Tensor v = is_distributed_param(item.value()) ? gather_logical(item.value()) : item.value().detach().clone();
    out[item.key()] = to_cpu ? v.to(at::kCPU) : v;
  }
  for (auto& item : module.named_buffers(true)) out[item.key()] = to_cpu ? item.value().to(at::kCPU) : item.value().clone();
  return out;
}

LoadResult load_state_dict(torch::nn::Module& module, const StateDict& state, bool strict) {
  wait_for_parameter_writers();
  LoadResult result;
  std::vector<std::string> mismatched;
  std::map<std::string, at::Tensor> targets;
  for (auto& item : module.named_parameters(true)) targets[item.key()] = item.value();
  for (auto& item : module.named_buffers(true)) targets[item.key()] = item.value();
  for (auto& kv : targets) {
    auto it = state.find(kv.first);
    if (it == state.end()) {
      result.missing_keys.push_back(kv.first);
      continue;
    }
    const at::Tensor& value = it->second;
    ParamMeta* m = find_meta(kv.second);
    std::vector<int64_t> want = m ? m->logical_shape() : kv.second.sizes().vec();
    at::ScalarType want_dtype = m ? m->dtype : kv.second.scalar_type();
    if (value.sizes().vec() != want || value.scalar_type() != want_dtype) {
      std::ostringstream os;
      os << kv.first << ": checkpoint has " << value.sizes() << " " << c10::toString(value.scalar_type())
         << ", model has " << at::IntArrayRef(want) << " " << c10::toString(want_dtype);
      mismatched.push_back(os.str());
    }
  }
  for (auto& kv : state)
    if (!targets.count(kv.first)) result.unexpected_keys.push_back(kv.first);
  if (!mismatched.empty() || (strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty()))) {
    std::ostringstream os;
    os << "load_state_dict failed on rank " << (is_initialized() ? rank() : 0) << ":";
    if (!result.missing_keys.empty()) {
      os << "\n  missing keys:";
      for (auto& k : result.missing_keys) os << " " << k;
    }
    if (!result.unexpected_keys.empty()) {
      os << "\n  unexpected keys:";
      for (auto& k : result.unexpected_keys) os << " " << k;
    }
    if (!mismatched.empty()) {
      os << "\n  shape/dtype mismatches:";
      for (auto& k : mismatched) os << "\n    " << k;
    }
    if (mismatched.empty()) os << "\n  (pass strict=false to load the matching keys only)";
    BMT_ERROR(os.str());
  }
  at::NoGradGuard guard;
  for (auto& kv : targets) {
    auto it = state.find(kv.first);
    if (it == state.end()) continue;
    if (is_distributed_param(kv.second))
      scatter_logical(kv.second, it->second.to(kv.second.device()));
    else
      kv.second.copy_(it->second);
  }
  return result;
}

}  // namespace bmt
