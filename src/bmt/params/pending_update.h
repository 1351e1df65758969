// PendingUpdate: an optimizer update of one parameter that may still be running after the optimizer's step()
// returned (AdamOffloadOptimizer::set_async_step). Whoever reads or writes the parameter waits for it first: a Block
// before it gathers (or reads, or writes) its shards, so the next forward waits only for the Blocks it reaches;
// state_dict, checkpoints and init_parameters wait for all of them.
//
// The update is host work on a ThreadPool (a TaskGroup of its own). For a device parameter the work ends by queuing
// the copy of the new value onto a device stream and recording an event right after it. wait() = the host waits for
// the work (rethrowing its first exception, once), then the CURRENT stream of that device waits for the event (no
// host synchronisation with the device).
//
// Registry: a DistributedParameter has at most one registered pending update (kept in its ParamMeta, only ever
// accessed through the functions below, which are thread-safe). Registering means "whoever touches this parameter
// must wait first"; the registration is dropped by the first wait.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <memory>
#include <optional>

#include "bmt/core/kernels/thread_pool.h"

namespace bmt {

class PendingUpdate {
 public:
  explicit PendingUpdate(core::kernels::ThreadPool& pool);  // the pool must outlive this object
  // Waits for the host work (its tasks may reference memory the owner frees next), swallowing its error.
  ~PendingUpdate();
  PendingUpdate(const PendingUpdate&) = delete;
  PendingUpdate& operator=(const PendingUpdate&) = delete;

  // Queues a piece of the host work (see ThreadPool::TaskGroup::run: it may run inline).
  void run(std::function<void()> task);
  // Called from inside a task of this update, at most once, right after it queued the copy back onto `stream`.
  void record_copy_back(const c10::Stream& stream);
  // True once every piece of the host work finished (does not wait, reports no error).
  bool host_done() const;
  // Host: waits for the work and rethrows its first error (once). Device: the current stream of the copy back's
  // device waits for it. Several threads may wait; waiting again is cheap.
  void wait();

 private:
  core::kernels::ThreadPool::TaskGroup tasks_;
  std::optional<c10::Event> copied_back_;  // written by one task before it finishes, read after tasks_.wait()
};

// Registers `update` as the pending update of `param` (a DistributedParameter without one: wait for the previous
// one first).
void set_pending_update(const at::Tensor& param, std::shared_ptr<PendingUpdate> update);
// The registered pending update of `param`, or nullptr (also for plain tensors).
std::shared_ptr<PendingUpdate> find_pending_update(const at::Tensor& param);
// Waits for `param`'s pending update and drops the registration; no-op if there is none. Rethrows its error.
void wait_pending_update(const at::Tensor& param);
// wait_pending_update for every parameter with a pending update (rethrows the first error after waiting for all).
void wait_all_pending_updates();
// Number of parameters with a registered pending update.
size_t num_pending_updates();

}  // namespace bmt
