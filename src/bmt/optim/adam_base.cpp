#include "bmt/optim/adam_base.h"

#include <ATen/core/grad_mode.h>
#include <cmath>
#include <sstream>
#include <unordered_set>

#include "bmt/core/error.h"
#include "bmt/params/param_meta.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt::optim {
namespace {

bool is_adam_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

at::Tensor cpu_copy(const at::Tensor& t) { return t.is_cpu() ? t.clone() : t.cpu(); }

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace

void AdamOptions::validate(const std::string& where) const {
  auto [b1, b2] = betas();
  BMT_CHECK(std::isfinite(lr()) && lr() >= 0, where, ": lr must be a finite number >= 0, got ", lr());
  BMT_CHECK(b1 >= 0 && b1 < 1, where, ": beta1 must be in [0, 1), got ", b1);
  BMT_CHECK(b2 >= 0 && b2 < 1, where, ": beta2 must be in [0, 1), got ", b2);
  BMT_CHECK(std::isfinite(eps()) && eps() > 0, where, ": eps must be a finite number > 0, got ", eps());
  BMT_CHECK(std::isfinite(weight_decay()) && weight_decay() >= 0, where,
            ": weight_decay must be a finite number >= 0, got ", weight_decay());
  BMT_CHECK(hold_steps() >= 0, where, ": hold_steps must be >= 0, got ", hold_steps());
}

std::vector<torch::optim::OptimizerParamGroup> make_param_groups(const std::vector<ParamGroupSpec>& specs,
                                                                 const AdamOptions& defaults) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < specs.size(); ++g) {
    auto opts = std::make_unique<AdamOptions>(defaults);
    auto [b1, b2] = defaults.betas();
    for (const auto& [key, value] : specs[g].options) {
      if (key == "lr") opts->lr(value);
      else if (key == "beta1") b1 = value;
      else if (key == "beta2") b2 = value;
      else if (key == "eps") opts->eps(value);
      else if (key == "weight_decay") opts->weight_decay(value);
      else if (key == "decoupled_weight_decay") {
        BMT_CHECK(value == 0 || value == 1, "param group ", g, ": decoupled_weight_decay must be 0 or 1, got ", value);
        opts->decoupled_weight_decay(value == 1);
      } else
        BMT_ERROR("param group ", g, ": unknown option '", key,
                  "' (Adam param groups accept lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay)");
    }
    opts->betas({b1, b2});
    groups.emplace_back(specs[g].params, std::move(opts));
  }
  return groups;
}

AdamBase::AdamBase(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, const AdamOptions& defaults)
    : BmtOptimizer(param_groups, std::make_unique<AdamOptions>(defaults)) {
  defaults.validate("Adam defaults");
  validate_groups();
}

void AdamBase::validate_groups() const {
  std::unordered_set<const void*> seen;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& group = param_groups_[g];
    std::string where = core::concat("Adam param group ", g);
    BMT_CHECK(group.has_options(), where, " has no options");
    const auto* opts = dynamic_cast<const AdamOptions*>(&group.options());
    BMT_CHECK(opts != nullptr, where, " has options of another optimizer type; build groups with ",
              "bmt::optim::AdamOptions (or ParamGroupSpec)");
    opts->validate(where);
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      BMT_CHECK(p.defined(), where, ": parameter ", i, " is undefined");
      BMT_CHECK(is_adam_dtype(p.scalar_type()), where, ": parameter ", i, " has dtype ", p.scalar_type(),
                "; Adam optimises float32, float16 and bfloat16 parameters");
      BMT_CHECK(p.is_contiguous(), where, ": parameter ", i, " is not contiguous");
      BMT_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, where, ": parameter ", i,
                " appears in more than one param group (or twice)");
    }
  }
}

const AdamOptions& AdamBase::group_options(size_t group) const {
  BMT_CHECK(group < param_groups_.size(), "param group ", group, " does not exist (", param_groups_.size(),
            " groups)");
  return static_cast<const AdamOptions&>(param_groups_[group].options());
}

const AdamState* AdamBase::find_state(const at::Tensor& p) const {
  wait_for_running_updates();
  auto it = states_.find(p.unsafeGetTensorImpl());
  return it == states_.end() ? nullptr : &it->second;
}

AdamState& AdamBase::state_for(const at::Tensor& p) {
  auto it = states_.find(p.unsafeGetTensorImpl());
  if (it == states_.end()) it = states_.emplace(p.unsafeGetTensorImpl(), new_state(p, false)).first;
  return it->second;
}

void AdamBase::refresh_master() {
  wait_for_running_updates();
  at::NoGradGuard no_grad;
  for (const auto& p : flat_params()) {
    auto it = states_.find(p.unsafeGetTensorImpl());
    if (it != states_.end() && it->second.master.defined()) it->second.master.copy_(p.detach().reshape_as(it->second.master));
  }
}

at::Tensor AdamBase::usable_grad(const at::Tensor& p) {
  if (!p.requires_grad()) return {};
  at::Tensor g = main_grad(p);
  if (!g.defined()) return {};
  BMT_CHECK(g.numel() == p.numel(), "Adam: the gradient of a parameter of shape ", p.sizes(), " has ", g.numel(),
            " elements");
  BMT_CHECK(g.device() == p.device(), "Adam: the gradient is on ", g.device(), " but its parameter on ", p.device());
  BMT_CHECK(is_adam_dtype(g.scalar_type()), "Adam: gradient dtype ", g.scalar_type(),
            " is not supported (use float32, float16 or bfloat16)");
  BMT_CHECK(p.is_contiguous(), "Adam: parameter of shape ", p.sizes(), " is not contiguous");
  return g.contiguous();
}

core::kernels::AdamTensorArgs AdamBase::kernel_args(void* param_data, const at::Tensor& param, const at::Tensor& grad,
                                                    AdamState& s, const AdamOptions& o) {
  core::kernels::AdamTensorArgs a;
  a.param = param_data;
  a.master = s.master.defined() ? s.master.data_ptr<float>() : nullptr;
  a.grad = grad.data_ptr();
  a.exp_avg = s.exp_avg.data_ptr<float>();
  a.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
  a.numel = param.numel();
  a.param_dtype = to_core_dtype(param.scalar_type());
  a.grad_dtype = to_core_dtype(grad.scalar_type());
  core::kernels::adam_step_scalars(a, effective_lr(param, s, o), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                   o.weight_decay(), s.step);
  return a;
}

double AdamBase::effective_lr(const at::Tensor& p, const AdamState& s, const AdamOptions& o) {
  // s.step counts this update. BMTrain holds fp32 updates while the count before it is < hold_steps, half ones
  // while the count after it is < hold_steps (one fewer).
  const bool held = p.scalar_type() == at::kFloat ? s.step - 1 < o.hold_steps() : s.step < o.hold_steps();
  return held ? 0.0 : o.lr();
}

StateDict AdamBase::state_dict() const { return state_dict_impl(/*copy=*/true); }
StateDict AdamBase::state_dict_views() const { return state_dict_impl(/*copy=*/false); }

StateDict AdamBase::state_dict_impl(bool copy) const {
  wait_for_running_updates();
  auto take = [copy](const at::Tensor& t) { return copy ? cpu_copy(t) : t.detach(); };
  StateDict sd;
  std::vector<at::Tensor> params = flat_params();
  sd["num_params"] = int_entry(static_cast<int64_t>(params.size()));
  sd["num_groups"] = int_entry(static_cast<int64_t>(param_groups_.size()));
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const AdamOptions& o = group_options(g);
    std::string k = core::concat("group.", g, ".");
    sd[k + "lr"] = scalar_entry(o.lr());
    sd[k + "beta1"] = scalar_entry(std::get<0>(o.betas()));
    sd[k + "beta2"] = scalar_entry(std::get<1>(o.betas()));
    sd[k + "eps"] = scalar_entry(o.eps());
    sd[k + "weight_decay"] = scalar_entry(o.weight_decay());
    sd[k + "num_params"] = int_entry(static_cast<int64_t>(param_groups_[g].params().size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    sd[core::concat("param.", i, ".shape")] = at::tensor(params[i].sizes().vec(), at::kLong);
    const AdamState* s = find_state(params[i]);
    if (s == nullptr) continue;
    std::string k = core::concat("state.", i, ".");
    sd[k + "step"] = int_entry(s->step);
    sd[k + "exp_avg"] = take(s->exp_avg).view(params[i].sizes());
    sd[k + "exp_avg_sq"] = take(s->exp_avg_sq).view(params[i].sizes());
    if (s->master.defined()) sd[k + "master"] = take(s->master).view(params[i].sizes());
  }
  return sd;
}

void AdamBase::load_state_dict(const StateDict& sd) {
  wait_for_running_updates();
  const char* what = "Adam optimizer";
  std::vector<at::Tensor> params = flat_params();
  int64_t n = get_int(sd, "num_params", what);
  BMT_CHECK(n == static_cast<int64_t>(params.size()), "load_state_dict of ", what, ": the state dict has ", n,
            " parameters but this optimizer has ", params.size(), " (a different model?)");
  int64_t groups = get_int(sd, "num_groups", what);
  BMT_CHECK(groups == static_cast<int64_t>(param_groups_.size()), "load_state_dict of ", what,
            ": the state dict has ", groups, " param groups but this optimizer has ", param_groups_.size());
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor shape = get_entry(sd, core::concat("param.", i, ".shape"), what);
    std::vector<int64_t> saved(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + shape.numel());
    BMT_CHECK(at::IntArrayRef(saved) == params[i].sizes(), "load_state_dict of ", what, ": parameter ", i,
              " has shape ", shape_str(params[i].sizes()), " but the state dict has ", shape_str(saved),
              " (a different model or sharding?)");
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    BMT_CHECK(get_int(sd, core::concat("group.", g, ".num_params"), what) ==
                  static_cast<int64_t>(param_groups_[g].params().size()),
              "load_state_dict of ", what, ": param group ", g, " has a different number of parameters");
  }
  // Everything checked: apply.
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    std::string k = core::concat("group.", g, ".");
    AdamOptions o = group_options(g);  // keeps hold_steps and decoupled_weight_decay (not in the state dict)
    o.lr(get_double(sd, k + "lr", what));
    o.betas({get_double(sd, k + "beta1", what), get_double(sd, k + "beta2", what)});
    o.eps(get_double(sd, k + "eps", what));
    o.weight_decay(get_double(sd, k + "weight_decay", what));
    o.validate(core::concat("load_state_dict: param group ", g));
    static_cast<AdamOptions&>(param_groups_[g].options()) = o;
  }
  at::NoGradGuard no_grad;
  // State tensors the load overwrites completely (placeholders) are reused when they fit: no allocation, no
  // first-touch page faults.
  std::unordered_map<const void*, AdamState> previous = std::move(states_);
  states_.clear();
  auto reusable = [&](const AdamState& s, const at::Tensor& p) {
    const bool half = p.scalar_type() != at::kFloat;
    for (const at::Tensor* t : {&s.exp_avg, &s.exp_avg_sq, &s.master}) {
      if (t == &s.master && !half) continue;
      if (!t->defined() || t->numel() != p.numel() || !t->is_contiguous() || t->device() != state_device(p) ||
          t->scalar_type() != at::kFloat)
        return false;
    }
    return half == s.master.defined();
  };
  for (size_t i = 0; i < params.size(); ++i) {
    std::string k = core::concat("state.", i, ".");
    if (!has_entry(sd, k + "step")) continue;
    // Placeholders (meta tensors, accepts_state_placeholders): the caller fills those tensors after this returns.
    const bool half = params[i].scalar_type() != at::kFloat;
    const bool unfilled = get_entry(sd, k + "exp_avg", what).is_meta() && get_entry(sd, k + "exp_avg_sq", what).is_meta() &&
                          (!half || (has_entry(sd, k + "master") && get_entry(sd, k + "master", what).is_meta()));
    auto old = previous.find(params[i].unsafeGetTensorImpl());
    AdamState& s = states_
                       .emplace(params[i].unsafeGetTensorImpl(),
                                unfilled && old != previous.end() && reusable(old->second, params[i])
                                    ? std::move(old->second)
                                    : new_state(params[i], unfilled))
                       .first->second;
    s.step = get_int(sd, k + "step", what);
    for (auto [name, dst] : {std::pair<const char*, at::Tensor*>{"exp_avg", &s.exp_avg}, {"exp_avg_sq", &s.exp_avg_sq}}) {
      const at::Tensor& src = get_entry(sd, k + name, what);
      BMT_CHECK(src.numel() == params[i].numel(), "load_state_dict of ", what, ": ", k, name, " has ", src.numel(),
                " elements, expected ", params[i].numel());
      if (!src.is_meta()) dst->copy_(src.reshape_as(*dst));
    }
    if (s.master.defined() && has_entry(sd, k + "master")) {
      const at::Tensor& src = get_entry(sd, k + "master", what);
      BMT_CHECK(src.numel() == params[i].numel(), "load_state_dict of ", what, ": ", k, "master has the wrong size");
      if (!src.is_meta()) s.master.copy_(src.reshape_as(s.master));
    }
  }
}

}  // namespace bmt::optim
