#include "bmt/param_registry.h"

#include <mutex>
#include <unordered_map>

#include "bmt/init.h"

namespace bmt {
namespace {

// The weak reference keeps a dead parameter's TensorImpl address from being reused while its entry exists.
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl{c10::weak_intrusive_ptr<c10::TensorImpl>::reclaim(nullptr)};
  at::Tensor main_grad;
  int replication = 0;  // 0 = not registered
};

std::mutex g_mutex;
std::unordered_map<const void*, Entry>& entries() {
  static std::unordered_map<const void*, Entry> map;
  return map;
}

const void* key_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// Entry for a live parameter (created on demand); stale entries of dead parameters are replaced.
Entry& entry_for(const at::Tensor& t) {
  auto& map = entries();
  auto it = map.find(key_of(t));
  if (it != map.end() && !it->second.impl.expired()) return it->second;
  Entry& e = map[key_of(t)];
  e = Entry();
  e.impl = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  return e;
}

const Entry* live_entry(const at::Tensor& t) {
  auto it = entries().find(key_of(t));
  if (it == entries().end() || it->second.impl.expired()) return nullptr;
  return &it->second;
}

}  // namespace

void set_main_grad(const at::Tensor& param, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entry_for(param).main_grad = grad;
}

void clear_main_grad(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = entries().find(key_of(param));
  if (it != entries().end()) entries().erase(it);
}

at::Tensor main_grad(const at::Tensor& param) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const Entry* e = live_entry(param);
    if (e && e->main_grad.defined()) return e->main_grad;
  }
  return param.grad();
}

void set_replication(const at::Tensor& param, int copies) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entry_for(param).replication = copies;
}

int replication(const at::Tensor& param) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const Entry* e = live_entry(param);
    if (e && e->replication > 0) return e->replication;
  }
  return is_initialized() ? world_size() : 1;
}

void forget_param(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries().erase(key_of(param));
}

}  // namespace bmt
