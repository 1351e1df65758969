// Causal multi-head attention: softmax(q·kᵀ/√hd + causal mask)·v, with the fused kernel torch would pick (its
// `_fused_sdp_choice`: cuDNN's or flash on GPUs, flash on CPUs) called as one autograd function of ours, so that a
// checkpointed Block can keep the output and log-sum-exp from its first run and skip the attention's forward in the
// recompute (recompute_keep.h; BlockOptions::keep_for_recompute). Operands no fused kernel takes (or torch older
// than 2.6 where it would take cuDNN's) go to at::scaled_dot_product_attention, nothing kept.
#pragma once

#include <ATen/ATen.h>

namespace bmt::nn {

// q (B, H, T, hd); k, v (B, Hkv, T, hd) with H % Hkv == 0 (grouped-query attention: each kv head serves H / Hkv
// consecutive query heads). Returns (B, H, T, hd).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Which kernel causal_attention runs for these operands (k and v with q's head count).
enum class AttentionKernel { kTorch, kFlash, kCudnn };
AttentionKernel causal_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace bmt::nn
