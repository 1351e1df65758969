// PipelineTransformerBlockList: pipeline parallelism over Blocks (BMTrain's bmt.PipelineTransformerBlockList, with
// a 1F1B schedule, per-stage storage and an explicit step).
//
// Layers are split contiguously over config().pipe_size stages (even split: stage s gets L/P layers plus one if
// s < L%P, BMTrain's rule; or a given partition). A stage builds and stores ONLY its own Blocks (BMTrain builds
// every layer on every rank); each Block shards over its stage's data-parallel group as usual (ZeRO-2 or 3, any
// tp_size), so pipeline, ZeRO and tensor parallelism compose. The local Blocks are registered as children named by
// their GLOBAL layer index ("0".."L-1"), so parameter names, state_dict keys and checkpoints do not depend on
// pipe_size: a checkpoint saved at one pipe size loads at any other.
//
// A training step is one call, forward_backward(step), on every rank: stage 0 asks step.first(m) for the hidden
// states of micro-batch m (the embedding), every stage runs its layers, the last stage asks step.last(m, hidden)
// for the micro-batch's loss and back-propagates loss / num_micro_batches (through step.scale_loss, e.g.
// OptimManager::scale_loss); activations and gradients travel point-to-point over config().pipe_comm (NCCL on
// config().pp_comm_stream on GPUs, Gloo on CPU). Parameter gradients accumulate as for one backward of the
// mean loss; the Blocks reduce them over their data-parallel group once, in the last micro-batch's backward.
// It returns the mean micro-batch loss on every stage (broadcast from the last), so sum_loss, clip_grad_norm (norm
// over all ranks, each parameter counted once), loss scaling (inf/NaN agreed over the world) and OptimManager::step
// work unchanged. Parameters outside the list (embedding, head) live on the stage that uses them.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/pipeline/pipeline_schedule.h"

namespace bmt {
namespace detail {
struct PipeLink;  // pipeline_p2p_internal.h
}  // namespace detail

struct PipelineOptions {
  int num_micro_batches = 0;  // 0: config().num_micro_batches (init_distributed's, default pipe_size)
  PipeSchedule schedule = PipeSchedule::k1F1B;
  std::vector<int64_t> partition;  // layers per stage (pipe_size entries summing to the layer count); empty: even
  int num_hidden = 1;              // hidden states threaded through the layers (the rest of the args are extras)
  int prefetch_depth = 1;          // as TransformerBlockList
};

struct PipeAutogradFn;

using BlockFactory = std::function<std::shared_ptr<Block>(int64_t layer)>;

class PipelineTransformerBlockList : public torch::nn::Module {
 public:
  // Calls make_block(layer) only for this stage's layers.
  PipelineTransformerBlockList(int64_t num_layers, const BlockFactory& make_block, PipelineOptions options = {});
  // BMTrain's form: every layer's Block given; this stage keeps its own (the others are dropped here, so their
  // storage is freed unless the caller still holds them).
  explicit PipelineTransformerBlockList(const std::vector<std::shared_ptr<Block>>& blocks,
                                        PipelineOptions options = {});

  struct Step {
    // Stage 0: the num_hidden hidden states entering layer 0 for micro-batch m.
    std::function<std::vector<at::Tensor>(int m)> first;
    // Last stage: the scalar loss of micro-batch m from the final hidden states.
    std::function<at::Tensor(int m, const std::vector<at::Tensor>& hidden)> last;
    // Every stage (optional): tensors passed after the hidden states to every layer (masks, positions).
    std::function<std::vector<at::Tensor>(int m)> extra_args;
    // Applied to each micro-batch loss before its backward (OptimManager::scale_loss); optional.
    std::function<at::Tensor(const at::Tensor&)> scale_loss;
  };
  // Forward and backward of every micro-batch (schedule from the options). Collective over the pipe group.
  // Returns the mean loss over micro-batches (fp32 scalar, detached) on every stage.
  at::Tensor forward_backward(const Step& step);
  // Forward only (no graph), micro-batches in order; returns the mean loss on every stage (evaluation).
  at::Tensor forward_only(const Step& step);

  // BMTrain's PipelineTransformerBlockList.forward (what the Python package's list calls). Every stage calls it
  // with its own batch: `inputs` = num_hidden hidden states (first dim b, the same b on every stage) followed by
  // extra args. The stages' batches are concatenated in stage order, cut into num_micro_batches micro-batches and
  // run through the stages (GPipe: every forward now; every backward, with the same transfers, when autograd reaches
  // this call); each stage gets back its own b rows of the last stage's output, differentiable, so the code before
  // and after the list (embedding, head, loss) runs data-parallel on every stage. Extras with first dim b are split
  // like the hidden states (their gradient comes back per stage); others go whole to every micro-batch and must not
  // require grad. Each output must have its input's shape and dtype (as between transformer layers). `context` is
  // handed to every Block call (the Python binding's non-tensor arguments).
  std::vector<at::Tensor> forward_autograd(const std::vector<at::Tensor>& inputs, CallContext context = nullptr);

  int num_stages() const { return stages_; }
  int stage_id() const { return stage_; }
  bool is_first_stage() const { return stage_ == 0; }
  bool is_last_stage() const { return stage_ == stages_ - 1; }
  int num_micro_batches() const { return micro_batches_; }
  void set_num_micro_batches(int m);
  PipeSchedule schedule() const { return options_.schedule; }
  int64_t num_layers() const { return num_layers_; }
  // [begin, end) of the layers of stage s (BMTrain's get_range_by_stage_id).
  std::pair<int64_t, int64_t> get_range_by_stage_id(int s) const;
  int get_stage_by_layer_id(int64_t layer) const;
  // This stage's Blocks (layers layer_range().first ...).
  const std::vector<std::shared_ptr<Block>>& blocks() const { return list_->blocks(); }
  std::pair<int64_t, int64_t> layer_range() const { return get_range_by_stage_id(stage_); }

  // Layers per stage for an even split (the first L % stages stages get one more).
  static std::vector<int64_t> even_partition(int64_t num_layers, int stages);

  // Parameters shared by the first and the last stage (a tied embedding and output projection). Each of the two
  // stages holds a copy (same name, same initialisation); after every forward_backward the two copies' gradients
  // are summed (over config().pipe_comm's first and last rank), so both take the same optimizer step, and each copy
  // counts half in the global gradient norm. Call on the first and the last stage with the copies in the same
  // order; other stages call nothing.
  void tie_first_last(const std::vector<at::Tensor>& params);

  // Seconds this rank's host spent in pipeline transfers during the last forward_backward.
  double last_wait_seconds() const { return last_wait_s_; }
  // With set_measure_busy(true): seconds of the last forward_backward this stage's device computed (the sum of its
  // forward and backward intervals, timed with events on the compute stream on GPUs, host clock on CPU; this
  // synchronises the device once per step). The bubble of the step is 1 - busy / (its duration).
  void set_measure_busy(bool on) { measure_busy_ = on; }
  double last_busy_seconds() const { return last_busy_s_; }

 private:
  friend struct PipeAutogradFn;  // forward_autograd's autograd function (pipeline_autograd.cpp)
  void setup(int64_t num_layers);
  void register_local(std::vector<std::shared_ptr<Block>> local);
  at::Tensor broadcast_loss(at::Tensor mean_loss);

  PipelineOptions options_;
  int stages_ = 1, stage_ = 0, micro_batches_ = 1;
  int64_t num_layers_ = 0;
  std::vector<int64_t> starts_;  // stages_ + 1 layer boundaries
  std::shared_ptr<TransformerBlockList> list_;  // this stage's Blocks (not a registered child)
  double last_wait_s_ = 0;
  bool measure_busy_ = false;
  double last_busy_s_ = 0;
  std::vector<at::Tensor> tied_;
  std::shared_ptr<core::Communicator> tied_comm_;  // first and last stage (created with the list: collective)
  std::shared_ptr<const detail::PipeLink> link_;  // the pipe communicator, its stream and device (setup)
};

}  // namespace bmt
