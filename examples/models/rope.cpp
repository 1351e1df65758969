#include "models/rope.h"

#include "bmt/core/error.h"

namespace examples {

RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, const at::Device& device) {
  BMT_CHECK(head_dim % 2 == 0, "rope: head_dim must be even, got ", head_dim);
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  // Exponents in fp64 then rounded, so the tables do not depend on the device's pow implementation.
  at::Tensor i = at::arange(0, head_dim / 2, at::TensorOptions().dtype(at::kDouble));
  at::Tensor inv_freq = at::pow(theta, -2.0 * i / static_cast<double>(head_dim));
  at::Tensor pos = at::arange(0, seq_len, at::TensorOptions().dtype(at::kDouble));
  at::Tensor angles = at::outer(pos, inv_freq);             // (T, hd/2)
  at::Tensor full = at::cat({angles, angles}, -1);          // (T, hd)
  return {at::cos(full).to(f32), at::sin(full).to(f32)};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& t) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor rotated = at::cat({-xf.narrow(-1, half, half), xf.narrow(-1, 0, half)}, -1);  // rotate_half
  return (xf * t.cos + rotated * t.sin).to(x.scalar_type());
}

}  // namespace examples
