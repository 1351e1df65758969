// Rotary position embedding (RoPE, "rotate half" convention of Llama in Hugging Face transformers).
//
// For head dimension hd, pair i (0 <= i < hd/2) couples elements i and i + hd/2 and rotates them by the angle
// p·θ_i at position p, θ_i = theta^(-2i/hd):
//   y_i        = x_i·cos(p·θ_i) − x_{i+hd/2}·sin(p·θ_i)
//   y_{i+hd/2} = x_{i+hd/2}·cos(p·θ_i) + x_i·sin(p·θ_i)
// so q·k after rotation depends only on the relative position of q and k.
#pragma once

#include <ATen/ATen.h>

namespace examples {

struct RopeTables {
  at::Tensor cos, sin;  // (T, hd), fp32: both halves repeat the hd/2 angles
};

RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, const at::Device& device);
// x (B, H, T, hd) -> rotated x (same shape and dtype; computed in fp32).
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables);

}  // namespace examples
