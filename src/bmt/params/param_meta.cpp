// The one per-parameter record: ParamMeta (DistributedParameters), main grad and replication.
#include "bmt/params/param_meta.h"

#include <algorithm>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta_internal.h"
#include "bmt/params/tensor_registry_internal.h"

namespace bmt {
namespace {

struct ParamRecord {
  std::shared_ptr<ParamMeta> meta;  // set for DistributedParameters only
  at::Tensor main_grad;
  std::function<void()> allocate_main_grad;  // set_lazy_main_grad
  int replication = 0;  // 0 = not registered
};

TensorRegistry<ParamRecord>& records() {
  static TensorRegistry<ParamRecord> registry;
  return registry;
}

}  // namespace

void register_meta(const at::Tensor& t, std::shared_ptr<ParamMeta> meta) {
  records().sweep();
  records().update(t, [&](ParamRecord& r) { r.meta = std::move(meta); });
}

std::shared_ptr<ParamMeta> take_meta(const at::Tensor& t) {
  std::shared_ptr<ParamMeta> meta = records().read(t, [](const ParamRecord* r) { return r ? r->meta : nullptr; });
  records().erase(t);
  return meta;
}

ParamMeta* find_meta(const at::Tensor& param) {
  if (!param.defined()) return nullptr;
  return records().read(param, [](const ParamRecord* r) { return r ? r->meta.get() : nullptr; });
}

void set_main_grad(const at::Tensor& param, const at::Tensor& grad) {
  records().update(param, [&](ParamRecord& r) { r.main_grad = grad; });
}

void set_lazy_main_grad(const at::Tensor& param, std::function<void()> allocate) {
  records().update(param, [&](ParamRecord& r) { r.allocate_main_grad = std::move(allocate); });
}

at::Tensor peek_main_grad(const at::Tensor& param) {
  at::Tensor g = records().read(param, [](const ParamRecord* r) { return r ? r->main_grad : at::Tensor(); });
  return g.defined() ? g : param.grad();
}

at::Tensor main_grad(const at::Tensor& param) {
  std::function<void()> allocate;
  at::Tensor g = records().read(param, [&](const ParamRecord* r) {
    if (!r) return at::Tensor();
    if (!r->main_grad.defined()) allocate = r->allocate_main_grad;
    return r->main_grad;
  });
  if (g.defined()) return g;
  if (allocate) {  // outside the registry's lock: it sets the main grads of the owner's parameters
    allocate();
    g = records().read(param, [](const ParamRecord* r) { return r ? r->main_grad : at::Tensor(); });
    if (g.defined()) return g;
  }
  return param.grad();
}

void set_replication(const at::Tensor& param, int copies) {
  records().update(param, [&](ParamRecord& r) { r.replication = copies; });
}

int replication(const at::Tensor& param) {
  int copies = records().read(param, [](const ParamRecord* r) { return r ? r->replication : 0; });
  if (copies > 0) return copies;
  return is_initialized() ? world_size() : 1;
}

void forget_param(const at::Tensor& param) {
  bool keep = false;
  records().update(param, [&](ParamRecord& r) {
    r.main_grad = at::Tensor();
    r.allocate_main_grad = nullptr;
    r.replication = 0;
    keep = r.meta != nullptr;
  });
  if (!keep) records().erase(param);
}

std::vector<int64_t> ParamMeta::logical_shape() const {
  std::vector<int64_t> s = full_shape;
  if (is_tp_split()) s[static_cast<size_t>(tp_split_dim)] *= tp_size;
  return s;
}

int replication_of(const ParamMeta& m, int stage_zero_size) {
  const int stage_copies = std::max(1, stage_zero_size / m.comm->size());
  return m.is_tp_split() ? std::max(1, stage_copies / m.tp_size) : stage_copies;
}

bool is_distributed_param(const at::Tensor& param) { return find_meta(param) != nullptr; }

bool in_block(const at::Tensor& param) {
  const ParamMeta* m = find_meta(param);
  return m != nullptr && m->block != nullptr;
}

ParamMeta& meta_of(const at::Tensor& param) {
  ParamMeta* m = find_meta(param);
  BMT_CHECK(m != nullptr, "tensor of shape ", param.sizes(), " is not a bmt::DistributedParameter (create it with "
            "bmt::DistributedParameter(...))");
  return *m;
}

}  // namespace bmt
