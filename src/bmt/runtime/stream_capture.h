// The stream-capture query: used by the engine (Block's RNG bookkeeping, CudaGraphStep) and by layers and losses
// that must not synchronise with the host while a CUDA graph is being captured.
#pragma once

#include <c10/core/Device.h>

namespace bmt {

// True when the calling thread's current stream of `device` is being captured into a CUDA graph
// (always false on CPU and in builds without CUDA). Code that must not run under capture (host synchronisation,
// device RNG state reads) checks it.
bool current_stream_capturing(const c10::Device& device);

}  // namespace bmt
