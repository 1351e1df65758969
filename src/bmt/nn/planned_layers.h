// Applying a TpPlan (nn/tp_plan.h): a model definition builds its layers through a TpBuilder and gets handles
// whose forward is the same whatever the plan chose, so the model's code does not know about tensor parallelism.
//
//   bmt::nn::TpBuilder tp(plan);                                  // validates the plan
//   bmt::nn::TpScope layer = tp.scope("layers.0");                // names below are "layers.0.<name>"
//   c_fc = layer.child("mlp").linear(mlp, "c_fc", d, ff, true, dtype);   // Linear / Column- / RowParallelLinear
//   layer.finish(*gpt_layer);                                     // the rest replicated; before make_block
//   ...
//   tp.finish(model);                                             // top-level modules; every entry matched?
//
// The chosen layer is registered in its parent under the module name (state_dict keys are the layer's own, the
// same at every tp_size). Errors name the module and the plan entry: a style that does not fit the layer (an
// Embedding planned column-parallel, a LayerNorm planned row-parallel), an entry matching no module, a size the
// tp_size does not divide.
#pragma once

#include <initializer_list>
#include <set>
#include <string>

#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/nn/tp_plan.h"

namespace bmt::nn {

// A Linear built from a plan: the dense Linear (replicated), a ColumnParallelLinear (column, vocab_head) or a
// RowParallelLinear (row). A handle, not a module; module() is the registered layer.
class PlannedLinear {
 public:
  PlannedLinear() = default;
  at::Tensor forward(const at::Tensor& x);
  // forward(x) in `parts` pieces of its last dimension (GPT's q, k, v): the dense layer's LinearImpl::forward_parts
  // (one node whose FP8 backward reads the pieces' gradients in place), the parallel layers' output chunked.
  std::vector<at::Tensor> forward_parts(const at::Tensor& x, int64_t parts);
  // forward() in two halves, so several layers reading one x communicate once (see shared_input):
  // column-parallel: ColumnParallelLinear::input_of / forward_input; otherwise x itself and forward().
  at::Tensor input_of(const at::Tensor& x) const;
  at::Tensor forward_input(const at::Tensor& input);
  // The style applied: the plan's, or kReplicated at tp_size 1.
  TpStyle style() const { return style_; }
  // Column-parallel (column or vocab_head): this rank computes a slice of the output features.
  bool splits_output() const { return static_cast<bool>(column_); }
  const std::string& name() const { return name_; }  // the module path, "layers.0.mlp.c_fc"
  // Output features this rank computes: out_features / tp_size for column-parallel layers, else out_features.
  int64_t local_out_features() const;
  torch::nn::Module& module() const;
  // The dense Linear when the style is replicated (tp_size 1 or a replicated plan entry), else an empty holder:
  // what a caller fusing this layer with its neighbours (nn::gelu_mlp, nn::linear_residual) needs.
  Linear dense() const { return dense_; }
  // FP8 GEMMs for whichever layer the plan built (Linear::fp8, ColumnParallelLinear::fp8, RowParallelLinear::fp8);
  // backward_only: the forward GEMM stays in the parameter dtype (Fp8LinearScales::backward_only).
  void set_fp8(bool on, bool backward_only = false);

 private:
  friend class TpScope;
  TpStyle style_ = TpStyle::kReplicated;
  std::string name_;
  Linear dense_{nullptr};
  ColumnParallelLinear column_{nullptr};
  RowParallelLinear row_{nullptr};
};

// The input of `layers` that all read x (Llama's wq, wk, wv): one all-gather of the rows for all of them. Throws
// naming the layers when the plan gave them different input layouts (column-parallel and not).
at::Tensor shared_input(const at::Tensor& x, std::initializer_list<const PlannedLinear*> layers);

// An Embedding built from a plan: the dense Embedding (replicated) or a VPEmbedding (vocab_embedding).
class PlannedEmbedding {
 public:
  PlannedEmbedding() = default;
  // Looks up ids (reusing an already gathered weight when given). Vocab-parallel: ids the same on every tp rank
  // (VPEmbedding::forward_replicated_ids), rows combined over tp.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& gathered_weight = {});
  // The tied output projection: full logits, or this rank's vocabulary slice when vocab-parallel.
  at::Tensor projection(const at::Tensor& x, const at::Tensor& gathered_weight = {});
  // The projection's GEMMs in FP8 (EmbeddingImpl::fp8 / VPEmbeddingImpl::fp8), or with backward_only its two
  // backward GEMMs only (the logits in the parameter dtype: Fp8LinearScales::backward_only); the lookup is unaffected.
  void set_fp8_projection(bool on, bool backward_only = false);
  const at::Tensor& weight() const;  // the parameter (bmt::gathered(weight()) for the tensor)
  bool vocab_parallel() const { return static_cast<bool>(vocab_); }
  const std::string& name() const { return name_; }
  torch::nn::Module& module() const;

 private:
  friend class TpScope;
  TpStyle style_ = TpStyle::kReplicated;
  std::string name_;
  Embedding dense_{nullptr};
  VPEmbedding vocab_{nullptr};
};

class TpBuilder;

// A place in the model's module tree ("" for the root, "layers.0.attn" below it) where layers are built.
class TpScope {
 public:
  TpScope child(const std::string& name) const;
  std::string path(const std::string& name) const;  // this scope's path + "." + name

  // Builds the Linear the plan gives path(name) and registers it in `parent` as `name`.
  PlannedLinear linear(torch::nn::Module& parent, const std::string& name, int64_t in_features, int64_t out_features,
                       bool bias, at::ScalarType dtype, InitMethod weight_init = init::normal(0.0, 0.02)) const;
  // Builds the Embedding the plan gives path(name) and registers it in `parent` as `name`.
  PlannedEmbedding embedding(torch::nn::Module& parent, const std::string& name, int64_t num_embeddings,
                             int64_t dim, at::ScalarType dtype,
                             InitMethod weight_init = init::normal(0.0, 0.02)) const;
  // `module` sits at this scope's path: every module in it not built through the plan is replicated. Checks that
  // plan entries naming such a module say replicated, and sets how its parameters' gradients combine over tp
  // (summed under sequence parallelism, averaged otherwise). Call before `module` is wrapped in a Block.
  void finish(torch::nn::Module& module) const;

 private:
  friend class TpBuilder;
  TpScope(TpBuilder* builder, std::string prefix) : builder_(builder), prefix_(std::move(prefix)) {}
  TpBuilder* builder_;
  std::string prefix_;
};

class TpBuilder {
 public:
  // Validates the plan (validate_tp_plan) and, at tp_size > 1, that plan.sequence_parallel equals
  // config().sequence_parallel.
  explicit TpBuilder(TpPlan plan);
  TpScope root() { return TpScope(this, ""); }
  TpScope scope(const std::string& path) { return TpScope(this, path); }
  // After the model is built: finishes the top-level modules (root().finish(model)) and throws naming every plan
  // entry that matched no module, with the model's module names.
  void finish(torch::nn::Module& model);

  const TpPlan& plan() const { return plan_; }
  bool splits() const;             // tp_size > 1: planned layers are split over tp
  bool sequence_parallel() const;  // splits() and the plan's token rows are split between regions

 private:
  friend class TpScope;
  // The layout for the module path `name` (replicated when no entry matches); records the match.
  TpLayout layout_of(const std::string& name);
  TpPlan plan_;
  std::set<std::string> matched_patterns_, planned_modules_, finished_modules_;
};

}  // namespace bmt::nn
