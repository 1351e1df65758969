// Head layout helpers shared by the GPT and Llama attention layers (no parameters here).
#pragma once

#include <ATen/ATen.h>

namespace examples {

// (B, T, H*hd) -> (B, H, T, hd)
at::Tensor split_heads(const at::Tensor& x, int64_t num_heads);
// (B, H, T, hd) -> (B, T, H*hd)
at::Tensor merge_heads(const at::Tensor& x);

// Causal attention itself is bmt::nn::causal_attention (bmt/nn/attention.h).

}  // namespace examples
