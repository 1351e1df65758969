// AdamOffloadOptimizer: Adam (AdamW) with its state in host memory and the update on the CPU, for parameters that
// live on a GPU (or on the CPU). Same update, options, state dict and results as AdamOptimizer (the same CPU kernel
// runs, so on CPU parameters both are bit-identical).
//
// Per parameter of a CUDA build with a CUDA parameter, one step is a pipeline:
//   1. (caller thread) the copy stream waits for the current stream; the gradient (and, for fp32 parameters, the
//      parameter) is copied into pinned host staging buffers; an event marks the copy.
//   2. (ThreadPool::global(), chunked) each chunk waits for that event, then runs the vectorised CPU Adam kernel on
//      the host fp32 master / exp_avg / exp_avg_sq, writing the new value into the pinned parameter staging buffer.
//   3. (the worker finishing the last chunk) the staging buffer is copied back into the parameter on the copy stream.
//   wait() joins the pool work and makes the current stream wait for the copy stream.
// CPU parameters skip 1 and 3 (the kernel reads the gradient and writes the parameter directly). No thread is
// created per step; the master, moments and gradients never leave pinned/host memory between steps. Only the
// transfer buffers are pinned: master and moments never cross the bus, so pinning them would only lock memory.
//
// Early start (overlap with the backward pass): step_params(params or flat indices, loss_scale) starts the update
// of a subset at once and returns; their gradients must be final (e.g. a Block whose backward is done) and must not
// be modified until the update finished (wait(), step() or zero_grad() wait for it). A later step() updates only
// the parameters not started yet in this iteration, then waits; the iteration ends with step() or zero_grad(), so a
// parameter can be started once per iteration. Early updates cannot be undone: start early only when the step will
// not be skipped (loss scaling disabled, or gradients checked with has_inf_nan first).
#pragma once

#include <memory>
#include <optional>
#include <unordered_set>

#include "bmt/core/kernels/thread_pool.h"
#include "bmt/optim/adam_base.h"

namespace bmt::optim {

class AdamOffloadOptimizer : public AdamBase {
 public:
  explicit AdamOffloadOptimizer(std::vector<at::Tensor> params, const AdamOptions& defaults = {});
  explicit AdamOffloadOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                                const AdamOptions& defaults = {});
  explicit AdamOffloadOptimizer(const std::vector<ParamGroupSpec>& param_groups, const AdamOptions& defaults = {});
  ~AdamOffloadOptimizer() override;

  // Starts the update of these parameters (flat indices, see flat_params(); or the parameter tensors themselves)
  // asynchronously. Parameters without a gradient are skipped; starting one twice in an iteration is an error.
  void step_params(const std::vector<size_t>& flat_indices, double loss_scale = 1.0);
  void step_params(const std::vector<at::Tensor>& params, double loss_scale = 1.0);
  // Blocks until every started update has been applied (CUDA: the current stream waits for the copies back).
  void wait();
  // Parameters started in the current iteration.
  size_t num_started() const { return started_.size(); }
  // The dtype in which CUDA gradients cross the bus and reach the CPU kernel. Default (nullopt): the gradient's
  // own dtype, exact (fp32 gradient shards of bf16 parameters). kBFloat16 / kHalf: the GPU rounds the gradient
  // first, as BMTrain's offload does: half the bus bytes and 2 fewer host-memory bytes per parameter and step (the
  // CPU update is host-bandwidth bound), at the cost of a gradient rounded to 8 (bf16) or 11 (fp16) bits.
  void set_grad_transfer_dtype(std::optional<at::ScalarType> dtype);
  std::optional<at::ScalarType> grad_transfer_dtype() const { return grad_transfer_dtype_; }
  // Waits for running updates first. (state_dict() does not wait: call it after step().)
  void load_state_dict(const StateDict& sd) override;

 protected:
  void do_step(double loss_scale) override;
  AdamState new_state(const at::Tensor& p) const override;
  void before_zero_grad() override;

 private:
  struct Staging;
  struct CudaStreams;
  void start_one(const at::Tensor& p, const AdamOptions& o, float inv_scale);
  void submit_chunks(const core::kernels::AdamTensorArgs& args, float inv_scale, std::function<void()> before,
                     std::function<void()> after);
  void end_iteration();

  std::unique_ptr<core::kernels::ThreadPool::TaskGroup> tasks_;
  std::unordered_set<const void*> started_;
  std::vector<at::Tensor> in_flight_;  // gradients / parameters read by running tasks
  std::unordered_map<const void*, std::unique_ptr<Staging>> staging_;
  std::unique_ptr<CudaStreams> cuda_;
  std::optional<at::ScalarType> grad_transfer_dtype_;
};

}  // namespace bmt::optim
