#include "bmt/params/pending_update.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/params/param_meta.h"

namespace bmt {
namespace {

// Guards every ParamMeta::pending_update and the set of parameters that have one.
std::mutex g_mutex;
std::unordered_map<const void*, at::Tensor>& registered() {  // keeps the parameters alive until waited for
  // Never destroyed: device tensors must not be freed during static destruction (CUDA may be gone already).
  static auto* params = new std::unordered_map<const void*, at::Tensor>;
  return *params;
}
// Lets wait_pending_update skip the lock when nothing is registered (every Block gather asks).
std::atomic<size_t> g_count{0};

void drop_if_current(ParamMeta& m, const at::Tensor& param, const std::shared_ptr<PendingUpdate>& update) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (m.pending_update != update) return;  // already dropped (and maybe replaced) by another waiter
  m.pending_update.reset();
  registered().erase(param.unsafeGetTensorImpl());
  g_count.store(registered().size(), std::memory_order_release);
}

}  // namespace

PendingUpdate::PendingUpdate(core::kernels::ThreadPool& pool) : tasks_(pool) {}

PendingUpdate::~PendingUpdate() {
  try {
    tasks_.wait();  // before copied_back_ is destroyed: a task may still be recording it
  } catch (...) {
  }
}

void PendingUpdate::run(std::function<void()> task) { tasks_.run(std::move(task)); }

void PendingUpdate::record_copy_back(const c10::Stream& stream) {
  copied_back_.emplace(stream.device_type());
  copied_back_->record(stream);
}

bool PendingUpdate::host_done() const { return tasks_.pending() == 0; }

void PendingUpdate::wait() {
  tasks_.wait();
  if (!copied_back_) return;
  c10::impl::VirtualGuardImpl impl(copied_back_->device_type());
  copied_back_->block(impl.getStream(copied_back_->device()));
}

void set_pending_update(const at::Tensor& param, std::shared_ptr<PendingUpdate> update) {
  BMT_CHECK(update != nullptr, "set_pending_update: the update is null");
  ParamMeta& m = meta_of(param);
  std::lock_guard<std::mutex> lock(g_mutex);
  BMT_CHECK(m.pending_update == nullptr, "set_pending_update: the parameter of shape ", param.sizes(),
            " already has a pending update (two asynchronous optimizers over one parameter?); call "
            "bmt::wait_pending_update(param) before starting another update");
  m.pending_update = std::move(update);
  registered()[param.unsafeGetTensorImpl()] = param;
  g_count.store(registered().size(), std::memory_order_release);
}

std::shared_ptr<PendingUpdate> find_pending_update(const at::Tensor& param) {
  ParamMeta* m = find_meta(param);
  if (m == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  return m->pending_update;
}

void wait_pending_update(const at::Tensor& param) {
  if (g_count.load(std::memory_order_acquire) == 0) return;
  ParamMeta* m = find_meta(param);
  if (m == nullptr) return;
  std::shared_ptr<PendingUpdate> update;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    update = m->pending_update;
  }
  if (!update) return;
  // Wait outside the lock (other parameters' waiters proceed); drop the registration only afterwards, so a
  // concurrent waiter of this parameter never sees it unregistered while the update still runs.
  try {
    update->wait();
  } catch (...) {
    drop_if_current(*m, param, update);
    throw;
  }
  drop_if_current(*m, param, update);
}

void wait_all_pending_updates() {
  if (g_count.load(std::memory_order_acquire) == 0) return;
  std::vector<at::Tensor> params;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto& kv : registered()) params.push_back(kv.second);
  }
  std::exception_ptr first;
  for (const auto& p : params) {
    try {
      wait_pending_update(p);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

size_t num_pending_updates() { return g_count.load(std::memory_order_acquire); }

}  // namespace bmt
