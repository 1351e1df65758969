// Fused cross-entropy (BMTrain's bmt.loss.FusedCrossEntropy), optionally vocabulary-parallel.
//
//   loss_i = -(1 - eps) * log p(target_i) - eps * mean_c log p(c),  p = softmax(logits_i) in fp32
// for every row whose target is not ignore_index (ignored rows: 0). Reductions: kNone -> (N,), kSum -> sum,
// kMean -> sum / number of non-ignored rows (0 when every row is ignored, never NaN). The loss is always fp32,
// whatever the logits' dtype (fp32, fp16, bf16; fp64 is computed in fp32); gradients come back in the logits'
// dtype. Unlike BMTrain, label smoothing also applies to half-precision logits. No class weights.
//
// parallel = true (tensor parallelism): each rank of bmt::config().tp_comm holds the vocabulary slice
// [tp_rank * C, (tp_rank + 1) * C) of a vocabulary of C * tp_size; every rank passes the same targets (global ids).
// Per-row statistics (max, sum of exp, target logit, shifted logit sum) are combined with one all-reduce(max) and one
// all-reduce(sum) of 3N floats: the full logits never exist. Every rank gets the same loss; the backward writes
// the gradient of the local slice and needs no communication.
//
// Checks (bmt::core::Error): logits 2-D float, target 1-D int64 of N entries on the same device, label_smoothing in
// [0, 1], targets in [0, vocabulary) unless ignore_index. The target check never synchronises with a GPU: on CPU it
// raises at once; on CUDA (parallel = false) a bad target makes that call's loss NaN and the error is raised by the
// next call, or by check_pending_targets(). In parallel mode bmtrain must be initialised and every tp rank must
// pass the same N, C, dtype and targets (one small all-reduce, read on the host, so that every rank raises the
// same error at once instead of hanging).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace bmt::loss {

enum class Reduction { kMean, kSum, kNone };

struct FusedCrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0.0;
  bool parallel = false;  // logits are this tp rank's vocabulary slice; reduce over bmt::config().tp_comm
  // The backward writes the gradient into the logits' memory instead of a new (N, C) tensor (BMTrain's `inplace`):
  // saves one logits-sized buffer at the memory peak. The logits then hold the gradient after backward, so use it
  // only when nothing reads them later (a language model's loss). Non-contiguous or fp64 logits get a private copy.
  bool inplace = false;
};

// Raises for a bad target seen by an earlier CUDA call whose verdict was not read yet (no-op otherwise).
void check_pending_targets();

// logits (N, C), target (N,) int64 -> fp32 loss (scalar, or (N,) for kNone). Differentiable in logits.
at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                               const FusedCrossEntropyOptions& options = {});

class FusedCrossEntropyImpl : public torch::nn::Module {
 public:
  explicit FusedCrossEntropyImpl(FusedCrossEntropyOptions options = {}) : options(options) {}
  at::Tensor forward(const at::Tensor& logits, const at::Tensor& target) {
    return fused_cross_entropy(logits, target, options);
  }
  FusedCrossEntropyOptions options;
};
TORCH_MODULE(FusedCrossEntropy);

}  // namespace bmt::loss
