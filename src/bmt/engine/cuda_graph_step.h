// CudaGraphStep: runs a training step's forward and backward as one CUDA graph once its input shapes are known
// (issue 17 item 1). A small model is launch-bound: replaying one graph costs one launch instead of thousands.
//
//   bmt::CudaGraphStep fwd_bwd([&](const std::vector<at::Tensor>& in) {
//     at::Tensor loss = model->loss(in[0], in[1]);
//     manager.backward(loss);                  // scale, backward, ZeRO reductions
//     return std::vector<at::Tensor>{loss.detach()};
//   });
//   for (...) {
//     at::Tensor loss = fwd_bwd({x, y}, manager.loss_scale())[0];
//     manager.step();                          // eager: its inf/NaN check reads the device on the host
//     manager.zero_grad();                     // in place (set_to_none = false): the graph adds into the same bytes
//   }
//
// How: every call runs on a side stream of its own (forked from, and joined back to, the caller's current stream).
// The first warmup_steps calls with a given signature (input shapes, dtypes, devices and the caller's `key`) run
// eagerly, so that everything allocated lazily (gradient shards, main gradients, cuBLAS workspaces) exists before
// the capture. The next call copies the inputs into static tensors, captures the function (at::cuda::CUDAGraph,
// a private memory pool, thread-local capture mode) with the ZeRO communication streams forked into the capture
// and joined back at its end, and replays it; later calls copy the inputs and replay. The returned tensors are
// copies of the graph's outputs (a replay overwrites the originals).
//
// Failures: a replay launches its collectives without calling the communicators, so each call first asks them
// (check_communicators_alive: aborted by the NCCL watchdog, or a peer-monitor verdict) and raises DistError naming
// the dead rank instead of replaying on aborted NCCL state.
//
// Fallback: a call whose signature differs from the captured one drops the graph and starts over (warm-up, then
// capture). A call inside GradSyncGuard (deferred reduction) or while an optimizer update is pending
// (AdamOffloadOptimizer::set_async_step) runs eagerly. On a CPU device, or in a build without CUDA, every call runs
// eagerly (a one-time notice; disabled_reason() says why): the same code trains everywhere. A capture that fails
// (an operation that is not capturable) prints the CUDA error and the stage, and turns graphs off for this object
// (eager from then on).
//
// The function must be replayable: the host code in it runs only while it is captured. What the step needs from
// the host must not change between calls (pass a changing host scalar such as the loss scale as `key`: a new key
// captures again), it must not synchronise with the device (no .item(), no host copies), must not draw random
// numbers on the device when Blocks recompute (checkpointing: the warm-up detects it and turns graphs off), and
// gradients must be zeroed in place between steps. Not supported inside the step: grad-ready hooks that update
// parameters (OptimManager::overlap_*_with_backward), pipeline schedules, bmt::inspect recording.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bmt/runtime/stream_capture.h"  // current_stream_capturing, declared here before

namespace bmt {

struct CudaGraphOptions {
  int warmup_steps = 2;  // eager calls per new signature before capturing (>= 1)
  bool verbose = false;  // print every capture and fallback (failures are printed always)
  // Synchronise after each capture and replay and raise any CUDA error there, naming the stage (debugging; also
  // on with the environment variable BMT_CUDA_GRAPHS_CHECK=1).
  bool check_errors = false;
};

using GraphStepFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

class CudaGraphStep {
 public:
  explicit CudaGraphStep(GraphStepFn fn, CudaGraphOptions options = {});
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // Runs the step on `inputs` (device tensors; replayed graphs read copies of them). `key`: a host value the step
  // depends on (e.g. OptimManager::loss_scale()); a different key captures again.
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs, double key = 0);

  // Drops the graph (e.g. after parameters were re-allocated); the next calls warm up and capture again.
  void reset();

  bool captured() const;                // a graph exists for the last signature
  int64_t num_captures() const { return num_captures_; }
  int64_t num_replays() const { return num_replays_; }
  int64_t num_eager() const { return num_eager_; }
  // Non-empty once graphs are off for good (CPU device, build without CUDA, a failed capture, device RNG with
  // recomputation): every call runs eagerly.
  const std::string& disabled_reason() const { return disabled_reason_; }
  // "graph" after a replay, "eager" after an eager call, "capture" after a capture (and its first replay).
  const std::string& last_mode() const { return last_mode_; }

  struct Impl;  // CUDA state (cuda_graph_step.cpp)

 private:
  std::vector<at::Tensor> run_eager(const std::vector<at::Tensor>& inputs);
  void disable(const std::string& why);

  GraphStepFn fn_;
  CudaGraphOptions options_;
  std::unique_ptr<Impl> impl_;
  std::string signature_;       // of the calls counted by eager_with_signature_
  int eager_with_signature_ = 0;
  int64_t num_captures_ = 0, num_replays_ = 0, num_eager_ = 0;
  std::string disabled_reason_;
  std::string last_mode_;
};

}  // namespace bmt
