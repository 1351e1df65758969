#include "bmt/param_registry.h"

#include <mutex>
#include <unordered_map>

#include "bmt/init.h"

namespace bmt {
namespace {

struct Entry {
  at::Tensor main_grad;
  int replication = 0;  // 0 = not registered
};

std::mutex g_mutex;
std::unordered_map<const void*, Entry>& entries() {
  static std::unordered_map<const void*, Entry> map;
  return map;
}

const void* key_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

}  // namespace

void set_main_grad(const at::Tensor& param, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries()[key_of(param)].main_grad = grad;
}

void clear_main_grad(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = entries().find(key_of(param));
  if (it != entries().end()) it->second.main_grad = at::Tensor();
}

at::Tensor main_grad(const at::Tensor& param) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = entries().find(key_of(param));
    if (it != entries().end() && it->second.main_grad.defined()) return it->second.main_grad;
  }
  return param.grad();
}

void set_replication(const at::Tensor& param, int copies) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries()[key_of(param)].replication = copies;
}

int replication(const at::Tensor& param) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = entries().find(key_of(param));
    if (it != entries().end() && it->second.replication > 0) return it->second.replication;
  }
  return is_initialized() ? world_size() : 1;
}

void forget_param(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries().erase(key_of(param));
}

}  // namespace bmt
