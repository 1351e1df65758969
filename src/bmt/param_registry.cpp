#include "bmt/param_registry.h"

#include "bmt/init.h"
#include "bmt/tensor_registry.h"

namespace bmt {
namespace {

struct Entry {
  at::Tensor main_grad;
  int replication = 0;  // 0 = not registered
};

TensorRegistry<Entry>& entries() {
  static TensorRegistry<Entry> registry;
  return registry;
}

}  // namespace

void set_main_grad(const at::Tensor& param, const at::Tensor& grad) {
  entries().update(param, [&](Entry& e) { e.main_grad = grad; });
}

void clear_main_grad(const at::Tensor& param) { entries().erase(param); }

at::Tensor main_grad(const at::Tensor& param) {
  at::Tensor g = entries().read(param, [](const Entry* e) { return e ? e->main_grad : at::Tensor(); });
  return g.defined() ? g : param.grad();
}

void set_replication(const at::Tensor& param, int copies) {
  entries().update(param, [&](Entry& e) { e.replication = copies; });
}

int replication(const at::Tensor& param) {
  int copies = entries().read(param, [](const Entry* e) { return e ? e->replication : 0; });
  if (copies > 0) return copies;
  return is_initialized() ? world_size() : 1;
}

void forget_param(const at::Tensor& param) { entries().erase(param); }

}  // namespace bmt
