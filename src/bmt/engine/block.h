// Block: ZeRO-2/3 execution of one module (a transformer layer).
//
// Storage: the module's parameters are packed, in named_parameters order, into one flat buffer per
// (dtype, requires_grad) group, each parameter starting on a 512-byte boundary; the flat buffer is cut into
// comm.size() equal partitions and this rank keeps partition `rank` (the shard). Each parameter tensor is
// re-pointed (set_data) at its local slice of the shard (possibly empty), so optimizers over
// module->parameters() update the shard in place. Gradients live in a flat grad shard per group (fp32 by default
// for half dtypes, see BlockOptions::reduce_dtype); each parameter's main_grad is its slice of it.
//
// One step (ZeRO-3): forward = gather (all_gather of every group) -> point parameters at the full buffers ->
// run the module (without building a graph when use_checkpoint) -> point back at the shard -> free the full
// buffers. Backward = gather again -> (recompute with the saved RNG state when use_checkpoint) -> gradients of
// inputs and parameters with torch::autograd::grad -> pack parameter gradients into a full flat buffer ->
// reduce_scatter (sum or avg, reduce_dtype) and add into the grad shard -> free. ZeRO-2 keeps the forward's full
// buffers until the end of the backward instead of gathering twice (and frees them then).
//
// Invariants: outside forward/backward every parameter points at its shard slice (is_gathered() == false);
// the full buffers exist only between gather() and release(); gradient reduction happens once per backward
// unless reduction is deferred with GradSyncGuard (accumulation over micro-batches).
// On CUDA, gathers and reductions run on config().load_stream, ordered against the compute stream by events.
// An optimizer may still be updating the shards after its step() returned (AdamOffloadOptimizer::set_async_step):
// gathering, gather_param_copy and scatter_param wait for this Block's pending updates first (pending_update.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bmt/core/communicator.h"
#include "bmt/params/parameter.h"

namespace bmt {

struct BlockOptions {
  int zero_level = 0;         // 2 or 3; 0 = config().zero_level
  bool use_checkpoint = true;  // recompute the forward in backward instead of keeping activations
  // With use_checkpoint: ops that can keep what the first run computed for the recompute do (recompute_keep.h:
  // bmt::nn::causal_attention's output, one activation per layer, spares the attention's forward).
  bool keep_for_recompute = true;
  at::ScalarType reduce_dtype = at::kFloat;  // dtype of gradient accumulation and reduce-scatter
  core::ReduceOp reduce_op = core::ReduceOp::kSum;  // kSum (BMTrain: divide the loss by grad_scale) or kAvg
};

using BlockForward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
// A value of one forward call that the forward function needs again when the backward recomputes it (a binding's
// non-tensor arguments and output structure, say). The Block keeps it with the call's saved state and makes it
// current (Block::current_call_context()) around every run of the forward function for that call.
using CallContext = std::shared_ptr<void>;

class TransformerBlockList;

class Block : public ParamOwner, public std::enable_shared_from_this<Block> {
 public:
  Block(std::shared_ptr<torch::nn::Module> module, BlockForward forward, BlockOptions options = {});
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  // Runs the module. Inputs that require grad receive gradients; others are passed through.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& inputs, CallContext context = nullptr);
  // The context of the call whose forward function runs on this thread (nullptr outside one, or when none given).
  static const CallContext& current_call_context();
  at::Tensor forward(const at::Tensor& input) { return forward(std::vector<at::Tensor>{input})[0]; }

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  int zero_level() const { return zero_level_; }
  bool use_checkpoint() const { return options_.use_checkpoint; }
  bool is_gathered() const override { return gathered_; }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  // Engine steps, public for TransformerBlockList and tests.
  void gather();   // all_gather the shards into full buffers (no-op if present) and point parameters at them
  void point_at_full();
  void point_at_shard();
  void release();  // drop the full buffers (parameters point at the shard)
  // Starts the all_gather only. Skipped while an asynchronous optimizer update of this Block still runs on the
  // host: waiting for it here would hold back the launch of the current Block's forward; gather() waits instead.
  void prefetch();

  int64_t shard_nbytes() const;
  int64_t full_nbytes() const;
  int64_t grad_nbytes() const;
  // Frees the gradient shards (after an optimizer already applied them, e.g. OptimManager::overlap_step_with_backward
  // with release_gradients): the parameters' main gradients become undefined until the next reduction, which
  // allocates zeroed shards again. Refused while a deferred (GradSyncGuard) accumulation is pending.
  void release_gradients();
  // Bytes held by the gathered buffers' storage, including storage that only autograd's saved views still
  // reference (ZeRO-3 without checkpointing frees it after forward and refills it before backward): 0 after release.
  int64_t gathered_storage_nbytes() const;
  // Full value of one of this block's parameters (a copy; collective over the block's communicator).
  at::Tensor gather_param_copy(const at::Tensor& param) override;
  // Writes this rank's part of `full` into one of this block's parameters.
  void scatter_param(const at::Tensor& param, const at::Tensor& full) override;

  // Called by the autograd function (internal).
  struct CallState;
  std::vector<at::Tensor> run_forward(CallState& state, const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> run_backward(CallState& state, const std::vector<at::Tensor>& grad_outputs);

 private:
  friend class TransformerBlockList;
  struct Group;
  struct Slot;
  void build_storage();
  void gather_buffers();
  // Waits for asynchronous optimizer updates of this Block's parameters (pending_update.h) before their shards are
  // read or written.
  void wait_pending_updates();
  static at::Tensor materialize_full(Group& g);
  // forward_fn_ with `context` current on this thread.
  std::vector<at::Tensor> call_forward_fn(const std::vector<at::Tensor>& inputs, const CallContext& context);
  void reduce_gradients(const std::vector<at::Tensor>& param_grads);
  // The group's gradient shard, allocated (zeroed) and pointed to by its parameters' main gradients if released.
  at::Tensor& grad_shard_of(size_t group_index);
  at::Tensor packed_gradient(const Group& g, size_t group_index, const std::vector<at::Tensor>& param_grads) const;
  // One rank, gradients taken over by a hook: the parameters' main gradients become their own gradients.
  void hand_over_gradients(size_t group_index, const std::vector<at::Tensor>& param_grads);
  // Handed-over gradients that must be accumulated into: copied into a (new) gradient shard.
  void adopt_handed_over_gradients(size_t group_index);

  std::shared_ptr<torch::nn::Module> module_;
  BlockForward forward_fn_;
  BlockOptions options_;
  int zero_level_ = 3;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<std::unique_ptr<Slot>> slots_;
  bool gathered_ = false;
  bool buffers_ready_ = false;
  at::Tensor anchor_;  // a grad-requiring scalar so the backward runs even when no input requires grad
  Block* prev_in_list_ = nullptr;  // the block whose backward follows ours (prefetched during our backward)
};

// Defers gradient reduction while alive (gradient accumulation over micro-batches without communication):
// Blocks keep accumulating into a full-size flat gradient buffer; the first backward after the guard is gone
// reduces everything accumulated once.
class GradSyncGuard {
 public:
  GradSyncGuard();
  ~GradSyncGuard();
};
bool grad_sync_enabled();

// Hooks called (in the backward, on the host) right after a Block reduced its gradients into its grad shards.
// On GPUs the reduction was queued on the comm stream: a hook that reads the gradients orders itself after it
// (wait_for_gradient_reduction()). Used to start an offloaded optimizer's update of that Block while the rest of
// the backward runs (OptimManager::overlap_offload_with_backward). Returns an id for remove_grad_ready_hook.
using GradReadyHook = std::function<void(Block&)>;
// Asked before a Block reduces its gradients: true when the hook applies and frees them as soon as they are reduced
// (OptimManager::overlap_step_with_backward). On one rank the Block then hands the optimizer the parameters' own
// gradients (bf16, say) instead of copying them into fp32 shards first: a pass over every gradient spared, the same
// numbers (the optimizer widens them as the copy would). Should the gradients outlive that (a second backward before
// the release), the next reduction moves them into a shard first.
using GradTakeoverQuery = std::function<bool(const Block&)>;
int add_grad_ready_hook(GradReadyHook hook, GradTakeoverQuery takes_over = nullptr);
void remove_grad_ready_hook(int id);
namespace detail {
// The hand-over above: on unless BMT_GRADIENT_HANDOVER=0 (benchmarks compare), settable from code.
bool gradient_handover_enabled();
void set_gradient_handover_enabled(bool on);
}  // namespace detail

// Wraps a module with `std::vector<at::Tensor> forward(const std::vector<at::Tensor>&)` or
// `at::Tensor forward(at::Tensor)` in a Block.
template <typename M>
std::shared_ptr<Block> make_block(std::shared_ptr<M> module, BlockOptions options = {}) {
  BlockForward fn;
  if constexpr (std::is_invocable_v<decltype(&M::forward), M*, const std::vector<at::Tensor>&>) {
    fn = [m = module.get()](const std::vector<at::Tensor>& in) { return m->forward(in); };
  } else {
    fn = [m = module.get()](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{m->forward(in.at(0))}; };
  }
  return std::make_shared<Block>(std::static_pointer_cast<torch::nn::Module>(module), std::move(fn), options);
}

}  // namespace bmt
