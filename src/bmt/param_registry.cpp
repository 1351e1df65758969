// The one per-parameter record: ParamMeta (DistributedParameters), main grad and replication.
#include "bmt/param_registry.h"

#include "bmt/init.h"
#include "bmt/param_registry_internal.h"
#include "bmt/parameter.h"
#include "bmt/tensor_registry_internal.h"

namespace bmt {
namespace {

struct ParamRecord {
  std::shared_ptr<ParamMeta> meta;  // set for DistributedParameters only
  at::Tensor main_grad;
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

at::Tensor main_grad(const at::Tensor& param) {
  at::Tensor g = records().read(param, [](const ParamRecord* r) { return r ? r->main_grad : at::Tensor(); });
  return g.defined() ? g : param.grad();
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
    r.replication = 0;
    keep = r.meta != nullptr;
  });
  if (!keep) records().erase(param);
}

}  // namespace bmt
