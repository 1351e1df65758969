// AdamOffloadOptimizer: Adam with its state in host memory and the update on the CPU, for parameters that live on
// a GPU (or on the CPU). Same update, options, state dict and results as AdamOptimizer on the CPU (the same code
// runs, so on CPU parameters both are bit-identical): half-precision parameters by the fused kernel (decoupled
// weight decay), fp32 ones by torch.optim.Adam's single-tensor op sequence (torch_adam.h) in one pool task each.
//
// Per parameter of a CUDA build with a CUDA parameter, one step is a pipeline:
//   1. (caller thread) the copy stream waits for the current stream; the gradient (and, for fp32 parameters, the
//      parameter) is copied into pinned host staging buffers; an event marks the copy.
//   2. (ThreadPool::global() or set_thread_pool's, chunked) each chunk waits for that event, then runs the vectorised
//      CPU Adam kernel on the host fp32 master / exp_avg / exp_avg_sq, writing the new value into the pinned
//      parameter staging buffer (fp32 parameters: one task, torch's ops on the staged copy).
//   3. (the worker finishing the last chunk) the staging buffer is copied back into the parameter on the copy stream
//      and an event is recorded after the copy.
//   The work of one parameter is one PendingUpdate (bmt/pending_update.h); waiting for it joins its pool work and
//   makes the current stream wait for its copy back.
// CPU parameters skip 1 and 3 (the kernel reads the gradient and writes the parameter directly). No thread is
// created per step; the master, moments and gradients never leave pinned/host memory between steps. Only the
// transfer buffers are pinned: master and moments never cross the bus, so pinning them would only lock memory.
//
// Early start (overlap with the backward pass; OptimManager::overlap_offload_with_backward() drives it per Block,
// with the inf/NaN check): step_params(params or flat indices, loss_scale) starts the update
// of a subset at once and returns; their gradients must be final (e.g. a Block whose backward is done) and must not
// be modified until the update finished (wait(), step() or zero_grad() wait for it). A later step() updates only
// the parameters not started yet in this iteration, then waits; the iteration ends with step() or zero_grad(), so a
// parameter can be started once per iteration. Early updates cannot be undone: start early only when the step will
// not be skipped (loss scaling disabled, or gradients checked with has_inf_nan first).
//
// Asynchronous step (set_async_step(true), off by default): step() returns once the parameters OUTSIDE Blocks are
// updated; the updates of Block parameters keep running and are registered as the parameters' pending updates. A
// Block waits for its own before it gathers, so the next forward waits only for the Blocks it reaches, Block by
// Block. zero_grad() does not wait for CUDA parameters' updates on the host (their kernels read pinned copies of
// the gradients: the current stream only waits for those copies), but does for CPU parameters (their kernels read
// the gradients). Everything else that reads or writes parameters or this state waits for all of them first:
// bmt::state_dict / load_state_dict, bmt::save / load, bmt::checkpoint::save / load, init_parameters, and this
// optimizer's state_dict, load_state_dict, find_state, wait() and destructor. Other direct readers of a Block's
// shards must call bmt::wait_pending_update(param) or bmt::wait_all_pending_updates() first.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_set>

#include "bmt/core/kernels/thread_pool.h"
#include "bmt/optim/adam_base.h"
#include "bmt/params/pending_update.h"

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
  // Blocks until every started update has been applied, also those still running after an asynchronous step()
  // (CUDA: the current stream waits for the copies back). Rethrows the first error of an update.
  void wait();
  // Asynchronous step (see above). Default off. Turning it off waits for every running update.
  void set_async_step(bool on);
  bool async_step() const { return async_step_; }
  // The pool running the CPU updates (default ThreadPool::global(); e.g. a test's pool whose worker it blocks). It
  // must outlive this optimizer. Waits for running updates first.
  void set_thread_pool(core::kernels::ThreadPool& pool);
  // Parameters started in the current iteration.
  size_t num_started() const { return started_.size(); }
  // The dtype in which CUDA gradients cross the bus and reach the CPU kernel. Default (nullopt): the gradient's
  // own dtype, exact (fp32 gradient shards of bf16 parameters). kBFloat16 / kHalf: the GPU rounds the gradient
  // first, as BMTrain's offload does: half the bus bytes and 2 fewer host-memory bytes per parameter and step (the
  // CPU update is host-bandwidth bound), at the cost of a gradient rounded to 8 (bf16) or 11 (fp16) bits.
  void set_grad_transfer_dtype(std::optional<at::ScalarType> dtype);
  std::optional<at::ScalarType> grad_transfer_dtype() const { return grad_transfer_dtype_; }
  // Waits for running updates first (state_dict() too).
  void load_state_dict(const StateDict& sd) override;

 protected:
  void do_step(double loss_scale) override;
  AdamState new_state(const at::Tensor& p, bool uninitialized) const override;
  c10::Device state_device(const at::Tensor&) const override { return at::kCPU; }
  void before_zero_grad() override;
  void wait_for_running_updates() const override;

 private:
  struct Staging;
  struct CudaStreams;
  // A started update until this optimizer saw it finish.
  struct InFlight {
    at::Tensor param;
    std::shared_ptr<PendingUpdate> update;
    std::vector<at::Tensor> keep_alive;  // gradient (and parameter) read by its tasks
    bool registered = false;             // the parameter's pending update (asynchronous step, Block parameter)
  };
  void start_one(const at::Tensor& p, const AdamOptions& o, double loss_scale);
  void start_on_device(const at::Tensor& p, at::Tensor grad, AdamState& s, const AdamOptions& o, double loss_scale,
                       PendingUpdate& update);
  // Waits for one in-flight update; returns its error instead of throwing.
  static std::exception_ptr finish(InFlight& f);
  void submit_chunks(PendingUpdate& update, const core::kernels::AdamTensorArgs& args, float inv_scale,
                     std::function<void()> before, std::function<void()> after);
  // The update of an fp32 parameter whose host values are `param_data`: torch.optim.Adam's single-tensor sequence
  // (torch_adam.h, as AdamOptimizer on the CPU), one task (splitting the tensor could change float results).
  void submit_fp32(PendingUpdate& update, const at::Tensor& param_data, const at::Tensor& grad, const AdamState& s,
                   const AdamOptions& o, double lr, double loss_scale, std::function<void()> before,
                   std::function<void()> after);
  // Waits for (and forgets) the in-flight updates `which` selects; returns the first error instead of throwing.
  std::exception_ptr finish_where(const std::function<bool(const InFlight&)>& which);
  void end_iteration();

  core::kernels::ThreadPool* pool_;
  bool async_step_ = false;
  bool copies_queued_ = false;  // CUDA copies queued since the last wait()
  std::unordered_set<const void*> started_;
  std::unordered_map<const void*, InFlight> in_flight_;  // by parameter
  std::unordered_map<const void*, std::unique_ptr<Staging>> staging_;
  std::unique_ptr<CudaStreams> cuda_;
  std::optional<at::ScalarType> grad_transfer_dtype_;
};

}  // namespace bmt::optim
