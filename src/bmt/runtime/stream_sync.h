// Stream ordering helpers for the engine, device-agnostic through c10::Stream / c10::Event: on CUDA they
// record an event on one stream and make another wait for it (no host sync); on CPU (no streams configured)
// they do nothing, since Gloo collectives complete before returning.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>

namespace bmt {

// BMTrain's names: calc_stream = the current stream of the configured device (nullopt on CPU); load_stream = the
// ZeRO communication stream config().load_stream (nullopt on CPU).
std::optional<c10::Stream> calc_stream();
std::optional<c10::Stream> load_stream();
// Makes `waiter` wait for the work queued so far on `producer`.
void stream_wait(const std::optional<c10::Stream>& waiter, const std::optional<c10::Stream>& producer);
// Makes the calc stream wait for every gradient reduction queued so far (call before reading gradients).
void wait_for_gradient_reduction();
// Inside a backward: the caller of backward() gets its current stream made to wait for the gradient reductions
// queued by the end of that backward (once per autograd graph task, as its final callback), so `p.grad` read right
// after `loss.backward()` holds the reduced values without an optimizer in between. Outside a backward: nothing.
void wait_for_gradient_reduction_after_backward();

}  // namespace bmt
