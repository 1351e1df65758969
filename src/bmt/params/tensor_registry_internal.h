// TensorRegistry<Record>: per-tensor records keyed by the tensor's TensorImpl (stable for a parameter's life, also
// across set_data), thread-safe. Each record holds a weak reference to its tensor: that keeps a dead tensor's
// address from being reused by a new tensor while the record exists, and tells lookups that the tensor is gone
// (a dead tensor's record is treated as absent and replaced or dropped).
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace bmt {

template <typename Record>
class TensorRegistry {
 public:
  // Runs f(Record&) under the lock on t's record, creating it first (or replacing a dead tensor's record).
  template <typename F>
  void update(const at::Tensor& t, F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key_of(t));
    if (it == map_.end() || it->second.impl.expired())
      it = map_.insert_or_assign(key_of(t), Slot{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), Record()})
               .first;
    std::forward<F>(f)(it->second.record);
  }

  // Returns f(const Record*) under the lock: t's live record, or nullptr (a dead tensor's record is dropped).
  template <typename F>
  auto read(const at::Tensor& t, F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key_of(t));
    if (it != map_.end() && it->second.impl.expired()) {
      map_.erase(it);
      it = map_.end();
    }
    return std::forward<F>(f)(it == map_.end() ? static_cast<const Record*>(nullptr) : &it->second.record);
  }

  void erase(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.erase(key_of(t));
  }

  // Drops the records of every dead tensor.
  void sweep() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = map_.begin(); it != map_.end();) it = it->second.impl.expired() ? map_.erase(it) : std::next(it);
  }

 private:
  struct Slot {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    Record record;
  };
  static const void* key_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

  std::mutex mutex_;
  std::unordered_map<const void*, Slot> map_;
};

}  // namespace bmt
