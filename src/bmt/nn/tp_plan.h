// A tensor-parallel plan: the parallel layout of a model as data, separate from the model's code (torchtitan's
// "TP plans"). One model definition asks a TpBuilder (nn/planned_layers.h) for each of its layers by module name;
// the plan decides which bmt::nn layer that name becomes at the configured tp_size:
//
//   style            a Linear becomes                              an Embedding becomes
//   kReplicated      Linear (every tp rank holds all of it)        Embedding
//   kColumn          ColumnParallelLinear (split_groups blocks)    -- (error)
//   kRow             RowParallelLinear                             -- (error)
//   kVocabEmbedding  -- (error)                                    VPEmbedding (lookup and tied vocab projection)
//   kVocabHead       ColumnParallelLinear over the vocabulary      -- (error)
//
// Module names are the model's module paths (the state_dict keys without ".weight"/".bias"); a "*" component
// matches any one component, so "layers.*.attn.c_attn" names the c_attn of every layer. Modules the plan does not
// name are replicated; their gradients combine over tp as sequence_parallel says (parameter.h, TpGradReduce).
// At tp_size 1 a plan changes nothing: every layer is the dense one.
//
// sequence_parallel: the activation layout between tensor-parallel regions (tp_ops.h). True: the token rows are
// split over tp (column-parallel inputs all-gathered, row-parallel outputs reduce-scattered); false: Megatron's
// replicated rows (row-parallel outputs all-reduced). It must equal the InitOptions::sequence_parallel the
// process was initialised with, which fixes the layout of parameters created outside the plan.
//
// The plan is plain data (names, an enum, ints, a bool) so bindings can build one; validate_tp_plan checks what
// can be checked without a model, TpBuilder the rest (names that match no module, styles that do not fit a layer).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace bmt::nn {

enum class TpStyle { kReplicated, kColumn, kRow, kVocabEmbedding, kVocabHead };

struct TpLayout {
  TpStyle style = TpStyle::kReplicated;
  // kColumn only: the output features are this many equal blocks (fused Q/K/V: 3), each split over tp.
  int64_t split_groups = 1;
};

struct TpPlan {
  std::map<std::string, TpLayout> modules;  // module name (with "*" components) -> layout
  bool sequence_parallel = true;
};

// "replicated", "column", "row", "vocab_embedding", "vocab_head".
const char* tp_style_name(TpStyle style);
// The inverse of tp_style_name; throws bmt::core::Error listing the names for an unknown one.
TpStyle tp_style_from_name(const std::string& name);

// Throws bmt::core::Error naming the entry when a name is empty or has an empty component ("a..b"), when
// split_groups < 1, or when split_groups > 1 is given for a style other than kColumn.
void validate_tp_plan(const TpPlan& plan);

// Whether `pattern` ("layers.*.attn.c_attn") matches the module path `name` ("layers.3.attn.c_attn"): the same
// number of dot-separated components, each equal or "*".
bool tp_plan_name_matches(const std::string& pattern, const std::string& name);

// The plan's entry (pattern, layout) matching the module path `name`, or nullptr when none does. Several matching
// entries are an error naming them.
const std::pair<const std::string, TpLayout>* find_tp_entry(const TpPlan& plan, const std::string& name);

}  // namespace bmt::nn
