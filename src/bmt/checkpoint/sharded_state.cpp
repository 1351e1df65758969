#include "bmt/checkpoint/sharded_state.h"

#include <algorithm>
#include <cctype>
#include <unordered_set>

#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"

namespace bmt::checkpoint {
namespace {

// "num_params", "group.<g>.num_params" of an optimizer (any prefix): how many parameters this rank's optimizer
// holds, which differs between pipeline stages.
bool is_pipeline_count(const std::string& key) {
  const std::string tail = "num_params";
  return key.size() >= tail.size() && key.compare(key.size() - tail.size(), tail.size(), tail) == 0 &&
         is_initialized() && config().pipe_size > 1;
}

std::vector<at::Tensor> group_params(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) out.push_back(p);
  return out;
}

class ManagerState final : public ShardedStateProvider {
 public:
  explicit ManagerState(optim::OptimManager& m) : m_(m) {}
  std::vector<ParamSpace> param_spaces() const override {
    std::vector<ParamSpace> out;
    for (size_t k = 0; k < m_.optimizers().size(); ++k) {
      auto* bmt_opt = dynamic_cast<optim::BmtOptimizer*>(m_.optimizers()[k].get());
      out.push_back({"optimizers." + std::to_string(k) + ".",
                     bmt_opt ? bmt_opt->flat_params() : group_params(*m_.optimizers()[k]), bmt_opt == nullptr,
                     bmt_opt != nullptr && bmt_opt->accepts_state_placeholders()});
    }
    return out;
  }
  optim::StateDict state_dict() const override { return m_.state_dict(); }
  optim::StateDict state_views() const override { return m_.state_dict_views(); }
  bool views_alias_live_state() const override { return true; }
  void load_state_dict(const optim::StateDict& sd) override { m_.load_state_dict(sd); }

 private:
  optim::OptimManager& m_;
};

class OptimizerState final : public ShardedStateProvider {
 public:
  explicit OptimizerState(optim::BmtOptimizer& o) : o_(o) {}
  std::vector<ParamSpace> param_spaces() const override {
    return {{"", o_.flat_params(), false, o_.accepts_state_placeholders()}};
  }
  optim::StateDict state_dict() const override { return o_.state_dict(); }
  optim::StateDict state_views() const override { return o_.state_dict_views(); }
  bool views_alias_live_state() const override { return true; }
  void load_state_dict(const optim::StateDict& sd) override { o_.load_state_dict(sd); }

 private:
  optim::BmtOptimizer& o_;
};

class SchedulerState final : public ShardedStateProvider {
 public:
  explicit SchedulerState(optim::lr_scheduler::WarmupLRScheduler& s) : s_(s) {}
  std::vector<ParamSpace> param_spaces() const override { return {}; }
  optim::StateDict state_dict() const override { return s_.state_dict(); }
  void load_state_dict(const optim::StateDict& sd) override { s_.load_state_dict(sd); }

 private:
  optim::lr_scheduler::WarmupLRScheduler& s_;
};

// "state.<i>.<name>" -> (i, name); "param.<i>.shape" -> (i, "#shape"); else false.
bool parse_indexed(const std::string& rest, size_t& index, std::string& name) {
  std::string head;
  if (rest.rfind("state.", 0) == 0) head = "state.";
  else if (rest.rfind("param.", 0) == 0) head = "param.";
  else return false;
  size_t pos = head.size(), digits = 0;
  index = 0;
  while (pos < rest.size() && std::isdigit(static_cast<unsigned char>(rest[pos])) && digits < 18) {
    index = index * 10 + static_cast<size_t>(rest[pos++] - '0');
    ++digits;
  }
  if (digits == 0 || pos >= rest.size() || rest[pos] != '.') return false;
  name = rest.substr(pos + 1);
  if (head == "param.") {
    if (name != "shape") return false;
    name = "#shape";
  }
  return !name.empty();
}

const ShardedStateProvider::ParamSpace* space_of(const std::vector<ShardedStateProvider::ParamSpace>& spaces,
                                                 const std::string& key) {
  const ShardedStateProvider::ParamSpace* best = nullptr;
  for (const auto& s : spaces)
    if (key.rfind(s.prefix, 0) == 0 && (!best || s.prefix.size() > best->prefix.size())) best = &s;
  return best;
}

LocalSlice whole(const std::string& key, const at::Tensor& t, std::map<std::string, std::string> attrs,
                 bool private_copy) {
  LocalSlice s;
  s.private_copy = private_copy;  // a fresh copy (state_dict), unless the provider returned live views
  s.data = t.detach();
  s.decl.key = key;
  s.decl.dtype = dtype_name(t.scalar_type());
  s.decl.shape = t.sizes().vec();
  s.decl.attrs = std::move(attrs);
  s.decl.begin = 0;
  s.decl.end = t.numel();
  return s;
}

}  // namespace

std::shared_ptr<ShardedStateProvider> sharded_state(optim::OptimManager& m) { return std::make_shared<ManagerState>(m); }
std::shared_ptr<ShardedStateProvider> sharded_state(optim::BmtOptimizer& o) { return std::make_shared<OptimizerState>(o); }
std::shared_ptr<ShardedStateProvider> sharded_state(optim::lr_scheduler::WarmupLRScheduler& s) {
  return std::make_shared<SchedulerState>(s);
}

std::vector<LocalSlice> provider_slices(const std::string& C, const ShardedStateProvider& provider,
                                        const std::unordered_map<const void*, std::string>& names, int rank) {
  const auto spaces = provider.param_spaces();
  std::vector<LocalSlice> out;
  const bool fresh = !provider.views_alias_live_state();
  for (const auto& kv : provider.state_views()) {
    const std::string& key = kv.first;
    const at::Tensor& t = kv.second;
    const auto* space = space_of(spaces, key);
    if (space && space->per_rank) {
      out.push_back(whole(C + "/rank/" + std::to_string(rank) + "/" + key, t,
                          {{"role", "rank"}, {"component", C}, {"rank", std::to_string(rank)}, {"sdkey", key}}, fresh));
      continue;
    }
    size_t i = 0;
    std::string name;
    if (!space || !parse_indexed(key.substr(space->prefix.size()), i, name) || i >= space->params.size()) {
      std::map<std::string, std::string> attrs{{"role", "global"}, {"component", C}, {"sdkey", key}};
      // Pipeline stages hold different parameters: counts of them are this rank's, not global.
      if (is_pipeline_count(key)) attrs["stage_local"] = "1";
      out.push_back(whole(C + "/global/" + key, t, attrs, fresh));
      continue;
    }
    if (name == "#shape") continue;  // regenerated on load
    const at::Tensor& p = space->params[i];
    auto nit = names.find(p.unsafeGetTensorImpl());
    BMT_CHECK(nit != names.end(), "checkpoint: ", C, " holds state for its parameter ", i, " (", space->prefix,
              "shape ", p.sizes(), ") which is not a parameter of the model being saved");
    const std::string& pname = nit->second;
    std::map<std::string, std::string> attrs = {
        {"component", C}, {"space", space->prefix}, {"param", pname}, {"name", name}};
    if (t.sizes() == p.sizes()) {
      ParamRange r = param_range(p, pname);
      LocalSlice s;
      s.private_copy = fresh;
      s.data = t.detach();
      s.decl.key = C + "/shard/" + space->prefix + pname + "/" + name;
      s.decl.dtype = dtype_name(t.scalar_type());
      s.decl.shape = r.full_shape;
      attrs["role"] = "shard";
      add_tp_attrs(r.layout, attrs);
      s.decl.attrs = std::move(attrs);
      s.decl.begin = r.begin;
      s.decl.end = r.end;
      out.push_back(std::move(s));
    } else {
      attrs["role"] = "param";
      out.push_back(whole(C + "/param/" + space->prefix + pname + "/" + name, t, std::move(attrs), fresh));
    }
  }
  return out;
}

optim::StateDict provider_state_from(const std::string& C, const ShardedStateProvider& provider,
                                     const std::unordered_map<const void*, std::string>& names, int rank,
                                     int world_size, CheckpointReader& reader, std::vector<std::string>& errors,
                                     std::vector<DeferredStateRead>* deferred) {
  const auto spaces = provider.param_spaces();
  // Per space: model name -> index.
  std::map<std::string, std::unordered_map<std::string, size_t>> index_of;
  for (const auto& s : spaces) {
    auto& m = index_of[s.prefix];
    for (size_t i = 0; i < s.params.size(); ++i) {
      auto nit = names.find(s.params[i].unsafeGetTensorImpl());
      if (nit == names.end()) {
        if (!s.per_rank)
          errors.push_back(C + ": parameter " + std::to_string(i) + " of " + (s.prefix.empty() ? "the optimizer" : s.prefix) +
                           " is not a parameter of the model");
        continue;
      }
      m[nit->second] = i;
    }
  }
  optim::StateDict sd;
  const int saved_ws = reader.metadata().world_size;
  bool per_rank_reported = false;
  std::vector<std::string> foreign;  // pipeline stages: parameters this rank does not hold
  std::vector<std::string> stage_local;  // pipeline stages: parameter counts, this rank's own
  for (const EntryMeta& e : reader.metadata().entries) {
    auto attr = [&](const char* k) -> std::string {
      auto it = e.attrs.find(k);
      return it == e.attrs.end() ? std::string() : it->second;
    };
    if (attr("component") != C) continue;
    const std::string role = attr("role");
    try {
      if (role == "global") {
        if (attr("stage_local") == "1" || (config().pipe_size > 1 && is_pipeline_count(attr("sdkey")))) {
          stage_local.push_back(attr("sdkey"));  // taken from this rank's current state below
          continue;
        }
        sd[attr("sdkey")] = reader.read_full(e);
      } else if (role == "rank") {
        if (saved_ws != world_size) {
          if (!per_rank_reported)
            errors.push_back(C + ": holds per-rank state (a plain torch::optim optimizer) saved at world size " +
                             std::to_string(saved_ws) + "; it cannot be resharded to world size " +
                             std::to_string(world_size));
          per_rank_reported = true;
        } else if (attr("rank") == std::to_string(rank)) {
          sd[attr("sdkey")] = reader.read_full(e);
        }
      } else if (role == "shard" || role == "param") {
        const std::string prefix = attr("space"), pname = attr("param");
        auto sit = index_of.find(prefix);
        if (sit == index_of.end()) {
          errors.push_back(C + ": the checkpoint has state for " + prefix + " which the current " + C + " lacks");
          continue;
        }
        auto pit = sit->second.find(pname);
        if (pit == sit->second.end() && config().pipe_size > 1) {
          foreign.push_back(pname);  // held by another pipeline stage? decided below, over every rank
          continue;
        }
        if (pit == sit->second.end()) {
          errors.push_back(C + ": the checkpoint has " + attr("name") + " state for parameter " + pname + " which " +
                           (prefix.empty() ? "the optimizer" : prefix) + " does not hold (a different model?)");
          continue;
        }
        const size_t i = pit->second;
        const std::string out_key = prefix + "state." + std::to_string(i) + "." + attr("name");
        const auto* space = space_of(spaces, prefix);
        const at::Tensor& p = space->params[i];
        if (role == "param") {
          sd[out_key] = reader.read_full(e);
          continue;
        }
        ParamRange r = param_range(p, pname);
        const TpLayout saved = entry_tp_layout(e.key, e.shape, e.attrs);
        if (saved.real_shape() != r.layout.real_shape()) {
          errors.push_back(C + ": " + attr("name") + " of " + pname + " has shape " + saved.describe() +
                           " in the checkpoint, the parameter has " + r.layout.describe() + " (a different model?)");
          continue;
        }
        if (deferred && space->state_placeholders && stored_like(e, r)) {
          sd[out_key] = at::empty(p.sizes(), at::TensorOptions().dtype(scalar_type_of(e.dtype)).device(at::kMeta));
          deferred->push_back({out_key, &e, r.begin, r.end});
          continue;
        }
        sd[out_key] = read_param_range(reader, e, r).view(p.sizes());
      } else {
        errors.push_back(C + ": entry " + e.key + " has unknown role \"" + role + "\"");
      }
    } catch (const std::exception& ex) {
      errors.push_back(ex.what());
    }
  }
  if (!stage_local.empty()) {
    const optim::StateDict now = provider.state_dict();
    for (const std::string& k : stage_local)
      if (auto it = now.find(k); it != now.end()) sd[k] = it->second;
  }
  if (config().pipe_size > 1) {
    std::sort(foreign.begin(), foreign.end());
    foreign.erase(std::unique(foreign.begin(), foreign.end()), foreign.end());
    for (const std::string& pname : detail::keys_on_every_rank(*config().comm, foreign))
      errors.push_back(C + ": the checkpoint has state for parameter " + pname +
                       " which no pipeline stage's optimizer holds (a different model?)");
  }
  for (const auto& s : spaces) {
    if (s.per_rank) continue;
    for (size_t i = 0; i < s.params.size(); ++i)
      sd[s.prefix + "param." + std::to_string(i) + ".shape"] = at::tensor(s.params[i].sizes().vec(), at::kLong);
  }
  return sd;
}

}  // namespace bmt::checkpoint
