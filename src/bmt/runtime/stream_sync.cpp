#include "bmt/runtime/stream_sync.h"

#include <c10/core/impl/VirtualGuardImpl.h>

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

}  // namespace bmt
