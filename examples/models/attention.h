// Causal multi-head attention math shared by the GPT and Llama layers (no parameters here).
#pragma once

#include <ATen/ATen.h>

namespace examples {

// (B, T, H*hd) -> (B, H, T, hd)
at::Tensor split_heads(const at::Tensor& x, int64_t num_heads);
// (B, H, T, hd) -> (B, T, H*hd)
at::Tensor merge_heads(const at::Tensor& x);

// softmax(q·kᵀ/√hd + causal mask)·v with at::scaled_dot_product_attention (flash / memory-efficient kernels on
// GPUs, a fused CPU kernel otherwise). q (B, H, T, hd); k, v (B, Hkv, T, hd) with H % Hkv == 0 (grouped-query
// attention: each kv head serves H / Hkv consecutive query heads).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace examples
