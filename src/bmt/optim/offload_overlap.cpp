#include "bmt/optim/offload_overlap.h"

#include <algorithm>
#include <unordered_set>

#include "bmt/engine/block.h"
#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/grad_utils.h"
#include "bmt/optim/offload_overlap_internal.h"
#include "bmt/params/parameter.h"

namespace bmt::optim {
namespace detail {
namespace {

// The parameters of `opt`, by TensorImpl.
std::unordered_set<const void*> param_set(const BmtOptimizer& opt) {
  std::unordered_set<const void*> out;
  for (const at::Tensor& p : opt.flat_params()) out.insert(p.unsafeGetTensorImpl());
  return out;
}

// The parameters of `params` that are in `owned`, in order.
std::vector<at::Tensor> owned_of(const std::vector<at::Tensor>& params, const std::unordered_set<const void*>& owned) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params)
    if (owned.count(p.unsafeGetTensorImpl())) out.push_back(p);
  return out;
}

}  // namespace

OffloadOverlapState::OffloadOverlapState(std::vector<std::shared_ptr<AdamOffloadOptimizer>> optimizers,
                                         std::vector<std::shared_ptr<AdamOptimizer>> device_optimizers,
                                         bool release_gradients)
    : optimizers_(std::move(optimizers)),
      device_optimizers_(std::move(device_optimizers)),
      release_gradients_(release_gradients) {
  for (const auto& opt : optimizers_) owned_.push_back(param_set(*opt));
  for (const auto& opt : device_optimizers_) device_owned_.push_back(param_set(*opt));
}

bool OffloadOverlapState::take_local_nonfinite() {
  bool found = local_nonfinite_host_;
  if (local_nonfinite_.defined()) {
    found = found || local_nonfinite_.item<int>() != 0;
    local_nonfinite_.zero_();
  }
  local_nonfinite_host_ = false;
  return found;
}

OffloadOverlapState::~OffloadOverlapState() { remove_hook(); }

void OffloadOverlapState::install() {
  // The hook holds the state weakly: removing the handle (and the manager forgetting it) frees everything.
  std::weak_ptr<OffloadOverlapState> weak = shared_from_this();
  hook_id_ = add_grad_ready_hook(
      [weak](Block& block) {
        if (auto self = weak.lock()) self->on_block_reduced(block);
      },
      [weak](const Block& block) {
        auto self = weak.lock();
        return self != nullptr && self->takes_over(block);
      });
}

bool OffloadOverlapState::takes_over(const Block& block) const {
  if (!release_gradients_ || device_optimizers_.empty()) return false;
  size_t trainable = 0, on_device = 0;
  for (const at::Tensor& p : block.module()->parameters()) {
    if (!p.requires_grad()) continue;
    ++trainable;
    const void* key = p.unsafeGetTensorImpl();
    for (const auto& owned : owned_)
      if (owned.count(key)) return false;  // an offloaded update copies the shard to the host: keep it fp32
    for (const auto& owned : device_owned_)
      if (owned.count(key)) {
        ++on_device;
        break;
      }
  }
  return trainable > 0 && on_device == trainable;
}

void OffloadOverlapState::remove_hook() {
  if (hook_id_ < 0) return;
  remove_grad_ready_hook(hook_id_);
  hook_id_ = -1;
}

void OffloadOverlapState::on_block_reduced(Block& block) {
  // An iteration ended without the manager (the optimizers' own step() or zero_grad()): start a new record.
  bool none_started = true;
  for (const auto& opt : optimizers_) none_started = none_started && opt->num_started() == 0;
  for (const auto& opt : device_optimizers_) none_started = none_started && opt->num_started() == 0;
  if (none_started && !early_blocks_.empty()) end_iteration();
  const std::vector<at::Tensor> block_params = block.module()->parameters();
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    const std::vector<at::Tensor> mine = owned_of(block_params, owned_[k]);
    if (mine.empty()) continue;  // a Block kept on another optimizer (e.g. GPU Adam)
    BMT_CHECK(seen_this_iteration_.insert({&block, k}).second, "overlap_offload_with_backward: a Block (",
              block.module()->name(), ") reduced its gradients twice in one iteration, but the overlap starts "
              "its update after the first reduction; accumulate micro-batches under bmt::GradSyncGuard (one reduction "
              "per step), or remove the OffloadOverlap handle");
    // The Block's communicators (its parameters' sharding groups), so every rank holding a shard of the Block
    // takes the same decision. grads_have_inf_nan orders itself after the gradient reduction.
    std::vector<core::Communicator*> comms;
    for (const at::Tensor& p : mine) {
      core::Communicator* c = meta_of(p).comm.get();
      if (std::find(comms.begin(), comms.end(), c) == comms.end()) comms.push_back(c);
    }
    const std::string what = core::concat("#", blocks_seen_, " (", block.module()->name(), ")");
    if (grads_have_inf_nan(mine, comms)) {
      nonfinite_blocks_.push_back(what);
      ++num_nonfinite_;
      continue;
    }
    optimizers_[k]->step_params(mine, /*loss_scale=*/1.0);  // loss scaling is refused
    early_blocks_.push_back(what);
    ++num_early_;
  }
  // Device optimizers: no host wait here (that would stall the launch of the rest of the backward); the inf/NaN
  // flag is checked by step(), which throws if an updated Block had one (the run diverged, as above).
  size_t updated_on_device = 0;
  for (size_t k = 0; k < device_optimizers_.size(); ++k) {
    const std::vector<at::Tensor> mine = owned_of(block_params, device_owned_[k]);
    if (mine.empty()) continue;
    BMT_CHECK(seen_this_iteration_.insert({&block, optimizers_.size() + k}).second, "overlap_step_with_backward: a "
              "Block (", block.module()->name(), ") reduced its gradients twice in one iteration, but its update "
              "starts after the first reduction; accumulate micro-batches under bmt::GradSyncGuard (one reduction per "
              "step), or remove the OffloadOverlap handle");
    local_nonfinite_host_ = accumulate_inf_nan_flag(mine, local_nonfinite_) || local_nonfinite_host_;
    device_optimizers_[k]->step_params(mine, /*loss_scale=*/1.0);
    early_blocks_.push_back(core::concat("#", blocks_seen_, " (", block.module()->name(), ")"));
    ++num_early_;
    updated_on_device += mine.size();
  }
  if (release_gradients_ && updated_on_device > 0) {
    size_t trainable = 0;
    for (const at::Tensor& p : block_params) trainable += p.requires_grad() ? 1 : 0;
    // Only when nothing else still needs these gradients (another optimizer's step(), say).
    if (updated_on_device == trainable) block.release_gradients();
  }
  ++blocks_seen_;
}

void OffloadOverlapState::end_iteration() {
  if (local_nonfinite_.defined()) local_nonfinite_.zero_();
  local_nonfinite_host_ = false;
  seen_this_iteration_.clear();
  early_blocks_.clear();
  nonfinite_blocks_.clear();
  blocks_seen_ = 0;
}

}  // namespace detail

OffloadOverlap::OffloadOverlap(std::shared_ptr<detail::OffloadOverlapState> state) : state_(std::move(state)) {}

OffloadOverlap::~OffloadOverlap() { remove(); }

OffloadOverlap::OffloadOverlap(OffloadOverlap&& other) noexcept : state_(std::move(other.state_)) {}

OffloadOverlap& OffloadOverlap::operator=(OffloadOverlap&& other) noexcept {
  if (this != &other) {
    remove();
    state_ = std::move(other.state_);
  }
  return *this;
}

void OffloadOverlap::remove() {
  if (state_) state_->remove_hook();  // the state (and its counters) stays until the handle goes
}

bool OffloadOverlap::active() const { return state_ != nullptr && state_->installed(); }

int64_t OffloadOverlap::num_early_starts() const { return state_ ? state_->num_early() : 0; }

int64_t OffloadOverlap::num_nonfinite_blocks() const { return state_ ? state_->num_nonfinite() : 0; }

}  // namespace bmt::optim
