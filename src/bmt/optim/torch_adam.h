// torch.optim.Adam's update of fp32 parameters, as ATen ops in the order torch 2.x's optim/adam.py issues them, so
// the result is bit-identical to torch.optim.Adam (and, with decoupled_weight_decay, torch.optim.AdamW) on the
// same device: the single-tensor path (torch's default on the CPU) and the foreach path (its default on CUDA).
// BMTrain's AdamOptimizer runs fp32 parameters through torch's own Adam; AdamOptimizer and AdamOffloadOptimizer
// do the same here. Half-precision parameters keep the fused kernels (core/kernels/adam.h).
//
// Every op is elementwise: a ZeRO shard's update equals the same elements of the full tensor's update. The host
// scalars (bias corrections, step sizes) are computed in double as Python computes them.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace bmt::optim::detail {

struct TorchAdamScalars {
  double lr = 1e-3;  // 0 while held (hold_steps)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled_weight_decay = false;  // torch's Adam(decoupled_weight_decay=True) == AdamW; else L2 (coupled)
  double loss_scale = 1.0;              // gradients are divided by it first (BMTrain: grad / scale)
};

// One fp32 parameter, torch's single-tensor sequence. `step` is the update's number (1 for the first). The
// gradient may be fp32, fp16 or bf16 (converted to fp32 first); it is not modified.
void torch_adam_single(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, int64_t step, const TorchAdamScalars& s);

// fp32 parameters of one device sharing the scalars (steps may differ), torch's foreach sequence.
void torch_adam_foreach(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<int64_t>& steps, const TorchAdamScalars& s);

}  // namespace bmt::optim::detail
