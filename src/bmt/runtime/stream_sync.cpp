#include "bmt/runtime/stream_sync.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>

#include "bmt/runtime/init.h"

namespace bmt {

std::optional<c10::Stream> calc_stream() {
  const Config& cfg = config();
  if (!cfg.device.is_cuda()) return std::nullopt;
  c10::impl::VirtualGuardImpl impl(cfg.device.type());
  return impl.getStream(cfg.device);
}

std::optional<c10::Stream> load_stream() { return config().load_stream; }

void stream_wait(const std::optional<c10::Stream>& waiter, const std::optional<c10::Stream>& producer) {
  if (!waiter || !producer || *waiter == *producer) return;
  c10::Event event(producer->device_type());
  event.record(*producer);
  event.block(*waiter);
}

void wait_for_gradient_reduction() {
  if (!is_initialized()) return;  // nothing distributed yet: no comm stream
  stream_wait(calc_stream(), load_stream());
}

void wait_for_gradient_reduction_after_backward() {
  if (!load_stream()) return;  // CPU: the reductions completed before returning
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0) return;
  static std::atomic<int> queued_for{-1};
  if (queued_for.exchange(task) == task) return;
  // The engine runs final callbacks with the backward caller's current streams set: calc_stream() is the caller's.
  torch::autograd::Engine::get_default_engine().queue_callback([] { wait_for_gradient_reduction(); });
}

}  // namespace bmt
