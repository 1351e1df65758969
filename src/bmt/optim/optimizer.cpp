#include "bmt/optim/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <cmath>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/param_meta_internal.h"
#include "bmt/runtime/stream_sync.h"

namespace {
// Gradients of Blocks are reduced on the comm stream: order the compute stream after it before reading or
// zeroing them (no host sync; a no-op on CPU).
void order_after_gradient_reduction() {
  if (bmt::is_initialized()) bmt::wait_for_gradient_reduction();
}
}  // namespace

namespace bmt::optim {
namespace {
constexpr const char* kArchiveKey = "bmt_state_dict";
}

BmtOptimizer::BmtOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(param_groups, std::move(defaults)) {}

at::Tensor BmtOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step(1.0);
  return loss;
}

void BmtOptimizer::step(double loss_scale) {
  BMT_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "optimizer step: loss_scale must be finite and > 0, got ",
            loss_scale);
  order_after_gradient_reduction();
  at::NoGradGuard no_grad;
  do_step(loss_scale);
}

void BmtOptimizer::zero_grad(bool set_to_none) {
  order_after_gradient_reduction();
  before_zero_grad();
  at::NoGradGuard no_grad;
  // CUDA tensors are zeroed together (a few fused launches instead of one per tensor: with hundreds of parameters
  // the launches, not the bytes, are the cost, and the GPU waits for them between two steps).
  std::vector<at::Tensor> cuda_zero;
  auto zero = [&](const at::Tensor& t) {
    if (t.is_cuda()) {
      if (t.numel() > 0) cuda_zero.push_back(t);
    } else {
      t.zero_();
    }
  };
  for (auto& group : param_groups_) {
    for (auto& p : group.params()) {
      at::Tensor own = p.grad();
      at::Tensor main = peek_main_grad(p);  // a Block gradient not allocated yet is zeros already
      // set_to_none drops .grad; the shard it viewed is zeroed too, so the next backward starts from zero (torch's
      // contract) instead of accumulating onto the gradient the user discarded.
      if (main.defined() && (set_to_none || !(own.defined() && main.is_same(own)))) zero(main);
      if (!own.defined()) continue;
      if (set_to_none) {
        p.mutable_grad().reset();
      } else {
        if (own.grad_fn()) own = own.detach();
        zero(own);
      }
    }
  }
  if (!cuda_zero.empty()) at::_foreach_zero_(cuda_zero);
}

std::vector<at::Tensor> BmtOptimizer::flat_params() const {
  std::vector<at::Tensor> out;
  for (const auto& group : param_groups_)
    for (const auto& p : group.params()) out.push_back(p);
  return out;
}

void BmtOptimizer::save(torch::serialize::OutputArchive& archive) const {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [k, v] : state_dict()) dict.insert(k, v);
  archive.write(kArchiveKey, c10::IValue(dict));
}

void BmtOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  BMT_CHECK(archive.try_read(kArchiveKey, value) && value.isGenericDict(),
            "optimizer load: the archive holds no bmtrain optimizer state ('", kArchiveKey, "')");
  StateDict sd;
  for (const auto& entry : value.toGenericDict()) sd[entry.key().toStringRef()] = entry.value().toTensor();
  load_state_dict(sd);
}

}  // namespace bmt::optim
