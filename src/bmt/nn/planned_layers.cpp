#include "bmt/nn/planned_layers.h"

#include <vector>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"

namespace bmt::nn {
namespace {

std::string join(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  return name.empty() ? prefix : prefix + "." + name;
}

// "layers.3.attn.c_attn" -> "layers.*.attn.c_attn": the model's module names without repeating every layer.
std::string collapse_indices(const std::string& name) {
  std::string out, component;
  auto flush = [&] {
    const bool index = !component.empty() && component.find_first_not_of("0123456789") == std::string::npos;
    out += (out.empty() ? "" : ".") + (index ? std::string("*") : component);
    component.clear();
  };
  for (char c : name) {
    if (c == '.') flush();
    else component += c;
  }
  flush();
  return out;
}

// Builds a split layer, prefixing the layer's own errors (sizes tp_size does not divide) with the module name.
template <typename Make>
auto build(const std::string& name, TpStyle style, Make make) {
  try {
    return make();
  } catch (const core::Error& e) {
    throw core::Error("tp plan: building " + name + " as " + tp_style_name(style) + ": " + e.what());
  }
}

// A built layer's FP8 switch and its backward-only choice (every FP8-capable layer has both); an empty handle: none.
template <class Layer>
void set_layer_fp8(Layer& layer, bool on, bool backward_only) {
  if (!layer) return;
  layer->fp8 = on;
  layer->fp8_scales.backward_only = backward_only;
}

}  // namespace

at::Tensor PlannedLinear::forward(const at::Tensor& x) {
  if (column_) return column_->forward(x);
  if (row_) return row_->forward(x);
  BMT_CHECK(dense_, "nn::PlannedLinear: empty handle; build it with TpScope::linear");
  return dense_->forward(x);
}

std::vector<at::Tensor> PlannedLinear::forward_parts(const at::Tensor& x, int64_t parts) {
  if (dense_) return dense_->forward_parts(x, parts);
  return forward(x).chunk(parts, -1);
}

void PlannedLinear::set_fp8(bool on, bool backward_only) {
  BMT_CHECK(dense_ || column_ || row_, "nn::PlannedLinear: empty handle; build it with TpScope::linear");
  set_layer_fp8(dense_, on, backward_only);
  set_layer_fp8(column_, on, backward_only);
  set_layer_fp8(row_, on, backward_only);
}

at::Tensor PlannedLinear::input_of(const at::Tensor& x) const { return column_ ? column_->input_of(x) : x; }

at::Tensor PlannedLinear::forward_input(const at::Tensor& input) {
  return column_ ? column_->forward_input(input) : forward(input);
}

int64_t PlannedLinear::local_out_features() const {
  if (column_) return column_->out_features_per_partition;
  if (row_) return row_->out_features;
  BMT_CHECK(dense_, "nn::PlannedLinear: empty handle; build it with TpScope::linear");
  return dense_->out_features;
}

torch::nn::Module& PlannedLinear::module() const {
  if (column_) return *column_.ptr();
  if (row_) return *row_.ptr();
  BMT_CHECK(dense_, "nn::PlannedLinear: empty handle; build it with TpScope::linear");
  return *dense_.ptr();
}

at::Tensor shared_input(const at::Tensor& x, std::initializer_list<const PlannedLinear*> layers) {
  BMT_CHECK(layers.size() > 0, "nn::shared_input: no layers given");
  const PlannedLinear& first = **layers.begin();
  auto layout = [](const PlannedLinear& l) { return l.splits_output(); };
  for (const PlannedLinear* l : layers)
    BMT_CHECK(layout(*l) == layout(first), "nn::shared_input: ", first.name(), " (", tp_style_name(first.style()),
              ") and ", l->name(), " (", tp_style_name(l->style()), ") read the same input but the tp plan gives "
              "them different input layouts; plan them alike (all column-parallel or all replicated)");
  return first.input_of(x);
}

at::Tensor PlannedEmbedding::forward(const at::Tensor& ids, const at::Tensor& gathered_weight) {
  if (vocab_) return vocab_->forward_replicated_ids(ids, gathered_weight);  // the rows' ids: same on every tp rank
  BMT_CHECK(dense_, "nn::PlannedEmbedding: empty handle; build it with TpScope::embedding");
  return dense_->forward(ids, gathered_weight);
}

at::Tensor PlannedEmbedding::projection(const at::Tensor& x, const at::Tensor& gathered_weight) {
  if (vocab_) return vocab_->projection(x, gathered_weight);
  BMT_CHECK(dense_, "nn::PlannedEmbedding: empty handle; build it with TpScope::embedding");
  return dense_->projection(x, gathered_weight);
}

void PlannedEmbedding::set_fp8_projection(bool on, bool backward_only) {
  BMT_CHECK(dense_ || vocab_, "nn::PlannedEmbedding: empty handle; build it with TpScope::embedding");
  set_layer_fp8(dense_, on, backward_only);
  set_layer_fp8(vocab_, on, backward_only);
}

const at::Tensor& PlannedEmbedding::weight() const {
  if (vocab_) return vocab_->weight;
  BMT_CHECK(dense_, "nn::PlannedEmbedding: empty handle; build it with TpScope::embedding");
  return dense_->weight;
}

torch::nn::Module& PlannedEmbedding::module() const {
  if (vocab_) return *vocab_.ptr();
  BMT_CHECK(dense_, "nn::PlannedEmbedding: empty handle; build it with TpScope::embedding");
  return *dense_.ptr();
}

TpScope TpScope::child(const std::string& name) const { return TpScope(builder_, path(name)); }

std::string TpScope::path(const std::string& name) const { return join(prefix_, name); }

PlannedLinear TpScope::linear(torch::nn::Module& parent, const std::string& name, int64_t in, int64_t out, bool bias,
                              at::ScalarType dtype, InitMethod weight_init) const {
  const std::string full = path(name);
  const TpLayout layout = builder_->layout_of(full);
  BMT_CHECK(layout.style != TpStyle::kVocabEmbedding, "tp plan: ", full, " is a Linear (in ", in, ", out ", out,
            ") but the plan makes it vocab_embedding; a Linear can be replicated, column, row or vocab_head");
  builder_->planned_modules_.insert(full);
  PlannedLinear l;
  l.name_ = full;
  if (!builder_->splits() || layout.style == TpStyle::kReplicated) {
    l.dense_ = parent.register_module(name, Linear(in, out, bias, dtype, std::move(weight_init)));
    return l;
  }
  const bool sp = builder_->sequence_parallel();
  l.style_ = layout.style;
  if (layout.style == TpStyle::kRow) {
    l.row_ = parent.register_module(name, build(full, layout.style, [&] {
      return RowParallelLinear(in, out, bias, dtype, /*split_input=*/false, /*all_reduce_output=*/!sp,
                               std::move(weight_init));
    }));
  } else {  // column, vocab_head: this rank's output features (its vocabulary slice for a head)
    l.column_ = parent.register_module(name, build(full, layout.style, [&] {
      return ColumnParallelLinear(in, out, bias, dtype, /*gather_output=*/false, /*gather_input=*/sp,
                                  std::move(weight_init), layout.split_groups);
    }));
  }
  return l;
}

PlannedEmbedding TpScope::embedding(torch::nn::Module& parent, const std::string& name, int64_t num, int64_t dim,
                                    at::ScalarType dtype, InitMethod weight_init) const {
  const std::string full = path(name);
  const TpLayout layout = builder_->layout_of(full);
  BMT_CHECK(layout.style == TpStyle::kReplicated || layout.style == TpStyle::kVocabEmbedding, "tp plan: ", full,
            " is an Embedding (", num, " x ", dim, ") but the plan makes it ", tp_style_name(layout.style),
            "; an Embedding can be replicated or vocab_embedding (its tied projection is then the vocab-parallel "
            "head)");
  builder_->planned_modules_.insert(full);
  PlannedEmbedding e;
  e.name_ = full;
  if (!builder_->splits() || layout.style == TpStyle::kReplicated) {
    e.dense_ = parent.register_module(name, Embedding(num, dim, dtype, std::move(weight_init)));
    return e;
  }
  e.style_ = layout.style;
  e.vocab_ = parent.register_module(name, build(full, layout.style, [&] {
    return VPEmbedding(num, dim, dtype, std::move(weight_init), builder_->sequence_parallel());
  }));
  return e;
}

void TpScope::finish(torch::nn::Module& module) const {
  const TpGradReduce reduce = builder_->sequence_parallel() ? TpGradReduce::kSum : TpGradReduce::kAvg;
  auto visit = [&](const std::string& full, torch::nn::Module& m) {
    if (!builder_->finished_modules_.insert(full).second) return;  // an inner scope finished it already
    if (!full.empty() && !builder_->planned_modules_.count(full)) {  // planned ones were checked when built
      const TpLayout layout = builder_->layout_of(full);
      BMT_CHECK(layout.style == TpStyle::kReplicated, "tp plan: ", full, " (", m.name(),
                ") was not built through the plan, so it can only be replicated, but the plan makes it ",
                tp_style_name(layout.style), "; build it with TpScope::linear / embedding or drop the entry");
    }
    if (!builder_->splits()) return;
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      if (is_distributed_param(p.value())) set_tp_grad_reduce(p.value(), reduce);
  };
  // Not named_modules(include_self): that needs `module` held by a shared_ptr, which a model in its own
  // constructor is not yet.
  visit(prefix_, module);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) visit(path(item.key()), *item.value());
}

TpBuilder::TpBuilder(TpPlan plan) : plan_(std::move(plan)) {
  validate_tp_plan(plan_);
  const Config& cfg = config();
  BMT_CHECK(cfg.tp_size <= 1 || plan_.sequence_parallel == cfg.sequence_parallel, "tp plan: sequence_parallel = ",
            plan_.sequence_parallel, " but bmt was initialised with sequence_parallel = ", cfg.sequence_parallel,
            " (the token layout of every parameter and activation follows InitOptions::sequence_parallel); make them "
            "equal");
}

bool TpBuilder::splits() const { return config().tp_size > 1; }

bool TpBuilder::sequence_parallel() const { return splits() && plan_.sequence_parallel; }

TpLayout TpBuilder::layout_of(const std::string& name) {
  const auto* entry = find_tp_entry(plan_, name);
  if (!entry) return TpLayout{};
  matched_patterns_.insert(entry->first);
  return entry->second;
}

void TpBuilder::finish(torch::nn::Module& model) {
  root().finish(model);
  std::vector<std::string> unmatched;
  for (const auto& entry : plan_.modules)
    if (!matched_patterns_.count(entry.first)) unmatched.push_back(entry.first);
  if (unmatched.empty()) return;
  std::set<std::string> names;
  for (const std::string& n : finished_modules_)
    if (!n.empty()) names.insert(collapse_indices(n));
  std::string missing, known;
  for (const std::string& n : unmatched) missing += (missing.empty() ? "'" : ", '") + n + "'";
  for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
  BMT_ERROR("tp plan: no module of the model matches ", missing, "; the model's modules are: ", known);
}

}  // namespace bmt::nn
