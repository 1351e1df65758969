// bmt::inspect: statistics of parameters, gradients and recorded activations (BMTrain's bmtrain.inspect).
//
// inspect_model(module, pattern) gives, per parameter whose name matches the shell pattern, the mean, std, min and
// max of the whole logical tensor and of its gradient. Nothing is gathered: each rank reduces its own shard to
// (count, sum, sum of squares, min, max) and those combine exactly over the parameter's ZeRO communicator (and,
// for tensor-parallel pieces, over the tp group). std is the population std (divides by the element count).
//
// inspect_tensor() returns an RAII scope; while it lives, record_tensor(x, name) called from forward code (also
// inside Blocks, also under activation checkpointing) records x's statistics and, in the backward, those of its
// gradient. A checkpointed Block runs its forward twice (once without a graph, once to recompute it in the
// backward): the recompute does not record again, it attaches the gradient hook to the entry the first run made.
// summary() combines every rank's records over the world (all ranks must record the same sequence), as BMTrain
// does, with exact pooled statistics; the shape reported is dim 0 times the world size.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace bmt::inspect {

// Statistics of one tensor. Grad fields are empty when there is no gradient.
struct TensorStats {
  std::string name;
  std::vector<int64_t> shape;
  double mean = 0, std = 0, min = 0, max = 0;
  std::optional<double> grad_mean, grad_std, grad_min, grad_max;
};

// Pooled moments of a set of values: combine exactly by adding counts and sums and taking min/max.
struct Moments {
  double count = 0, sum = 0, sum_sq = 0;
  double min = 0, max = 0;  // valid when count > 0
  void add(const at::Tensor& x);                                  // local values (any dtype/device)
  double mean() const { return count > 0 ? sum / count : 0.0; }
  double std() const;                                             // population std
};

// Per-parameter statistics of `module` (recursively named), for the names matching `pattern` (fnmatch-style:
// '*' matches any run of characters, dots included, '?' one character, [abc] / [!abc] a set). Collective: every rank
// of every communicator involved must call it, with the same module structure.
std::vector<TensorStats> inspect_model(torch::nn::Module& module, const std::string& pattern = "*");
// The same over explicit (name, tensor) pairs (the Python package passes its module's named_parameters()).
std::vector<TensorStats> inspect_parameters(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                            const std::string& pattern = "*");

struct RecordedTensor;  // inspect.cpp

// The scope of inspect_tensor(). Scopes nest; record_tensor records into the innermost.
class InspectTensor {
 public:
  InspectTensor();
  ~InspectTensor();
  InspectTensor(const InspectTensor&) = delete;
  InspectTensor& operator=(const InspectTensor&) = delete;

  // Stops recording (the destructor does it too); gradients of what was recorded keep arriving in the backward.
  void close();
  // Statistics over the world of every record, in recording order, named "{group.}{index}.{name}" where index
  // counts the earlier records of the same group and name. Collective over the world.
  std::vector<TensorStats> summary() const;
  // The tensor (detached) recorded as `name` in `group` ("" for none), the index-th such record (-1: the only
  // one; throws when there are several or none).
  at::Tensor get_tensor(const std::string& name, const std::string& group = "", int64_t index = -1) const;
  // The gradient recorded for it (undefined until its backward ran).
  at::Tensor get_grad(const std::string& name, const std::string& group = "", int64_t index = -1) const;
  size_t size() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Records `x` into the innermost open InspectTensor scope (no-op when none). `x` must not be a DistributedParameter
// (record activations; inspect parameters with inspect_model).
void record_tensor(const at::Tensor& x, const std::string& name, const std::string& group = "");

// BMTrain's table: columns name, shape, max, min, std, mean, grad_std, grad_mean; widths longest name + 4, 20 and
// 10 for each number; numbers with 4 decimals; a missing gradient is left blank.
std::string format_summary(const std::vector<TensorStats>& summary);

namespace detail {
// How Blocks tie a recompute to the records of the first run (block.cpp): mark() before the forward, span(mark)
// after it; ReplayScope(span) around the recompute makes record_tensor attach gradient hooks to those records
// instead of adding new ones.
struct RecordSpan {
  std::shared_ptr<InspectTensor::State> state;  // null: nothing was recorded
  size_t begin = 0, end = 0;
};
struct RecordMark {
  std::shared_ptr<InspectTensor::State> state;
  size_t begin = 0;
};
RecordMark mark();
RecordSpan span_since(const RecordMark& mark);
class ReplayScope {
 public:
  explicit ReplayScope(const RecordSpan& span);
  ~ReplayScope();
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;

 private:
  void* previous_;
};
// fnmatch-style matching used by inspect_model.
bool glob_match(const std::string& pattern, const std::string& name);
}  // namespace detail

}  // namespace bmt::inspect
